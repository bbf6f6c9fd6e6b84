"""`auto` ranks by evidence: pure tests over synthetic histories and evidence (no processes; the real
half, with engines, CRIU and bench: test_ranking_measured.py)."""
from restartkit.contracts import Evidence, Facts, ServiceFacts
from restartkit.evidence import context, summarize
from restartkit.planner import make_plan, render_plan
from restartkit.policy import parse_policy
from tests.helpers import Always, host

NAMES = ("sleep", "ipc", "criu", "cold")


def policy(**restart):
    return parse_policy({"service": {"name": "s", "model": "/m"}, "restart": restart})


def facts(evidence: dict[str, Evidence]) -> Facts:
    return Facts(host=host(), service=ServiceFacts(engine="reference", engine_running=True, engine_ready=True),
                 evidence=evidence)


def measured(name, t, n=3, **kw) -> Evidence:
    return Evidence(name, time_s=t, source="measured", n=n, detail=f"median of the last {n}", **kw)


def everyone_eligible(but=()):
    return {n: Always(n, ok=n not in but) for n in NAMES}


def test_criu_measured_slower_than_cold_runs_cold():
    ev = {"sleep": Evidence("sleep"), "ipc": Evidence("ipc"), "criu": measured("criu", 14.4), "cold": measured("cold", 9.1)}
    plan = make_plan(facts(ev), policy(), "auto", everyone_eligible(but=("sleep", "ipc")))
    assert plan.attempt == "cold" and plan.ranked_by == "time_to_ready"
    assert plan.order == ["sleep", "ipc", "cold", "criu"]
    assert any(n.startswith("auto chose cold: ready in 9.10 s (measured") and "criu 14.40 s" in n for n in plan.notes)
    text = render_plan(plan)
    assert "expected 9.10 s (measured)" in text and "expected 14.40 s (measured)" in text
    # the record carries the numbers it used
    d = plan.to_dict()
    assert d["ranked_by"] == "time_to_ready"
    assert {s["strategy"]: s["expected"]["seconds"] for s in d["strategies"]}["criu"] == 14.4


def test_ipc_fastest_runs_ipc_and_unmeasured_sleep_keeps_its_place():
    ev = {"sleep": Evidence("sleep"), "ipc": measured("ipc", 3.4), "criu": measured("criu", 14.4),
          "cold": measured("cold", 9.1)}
    plan = make_plan(facts(ev), policy(), "auto", everyone_eligible(but=("sleep",)))
    assert plan.attempt == "ipc" and plan.order == ["sleep", "ipc", "cold", "criu"]
    plan = make_plan(facts(ev), policy(), "auto", everyone_eligible())
    assert plan.attempt == "sleep"  # no number: the built-in order's first place
    assert any("no measurement here yet for sleep (built-in order)" in n and "--strategies sleep,cold" in n
               for n in plan.notes)


def test_a_strategy_with_recent_failures_is_ranked_last_with_its_reason():
    ev = {"sleep": Evidence("sleep"), "ipc": measured("ipc", 3.4, failures=2, failed_at=1.0, retry_in_s=1800),
          "criu": measured("criu", 5.0), "cold": measured("cold", 9.1)}
    plan = make_plan(facts(ev), policy(), "auto", everyone_eligible(but=("sleep",)))
    assert plan.attempt == "criu" and plan.order[-1] == "ipc"
    assert any("ipc is ranked last: its last 2 restart(s) ended in recovery" in n and "30 min" in n for n in plan.notes)


def test_no_history_uses_labelled_estimates_or_the_builtin_order():
    ev = {"sleep": Evidence("sleep"), "ipc": Evidence("ipc", time_s=1.0, source="estimated", detail="a guess"),
          "criu": Evidence("criu"), "cold": Evidence("cold", time_s=2.5, source="estimated", detail="its own start")}
    plan = make_plan(facts(ev), policy(), "auto", everyone_eligible(but=("sleep",)))
    assert plan.attempt == "ipc" and "expected 1.00 s (estimated)" in render_plan(plan)
    assert any("(estimated: a guess)" in n for n in plan.notes)
    nothing = {n: Evidence(n) for n in NAMES}
    plan = make_plan(facts(nothing), policy(), "auto", everyone_eligible(but=("sleep",)))
    assert plan.attempt == "ipc" and plan.ranked_by == "order"
    assert any("the first eligible in sleep > ipc > criu > cold" in n for n in plan.notes)
    assert any("no measurement here yet for ipc (built-in order)" in n and "restartkit bench" in n for n in plan.notes)
    assert "expected: unknown (built-in order)" in render_plan(plan)


def test_the_operator_stays_in_charge():
    ev = {"sleep": Evidence("sleep"), "ipc": Evidence("ipc"), "criu": measured("criu", 14.4), "cold": measured("cold", 9.1)}
    elig = everyone_eligible(but=("sleep", "ipc"))
    assert make_plan(facts(ev), policy(strategies=["criu", "cold"]), "auto", elig).attempt == "criu"  # explicit order
    plan = make_plan(facts(ev), policy(rank="order"), "auto", elig)
    assert plan.attempt == "criu" and plan.ranked_by == "order" and not plan.expected
    assert make_plan(facts(ev), policy(), "criu", elig).attempt == "criu"  # asked for by name


def test_overlapped_restarts_rank_by_client_seen_downtime():
    ev = {"sleep": Evidence("sleep"), "ipc": measured("ipc", 4.0, downtime_s=0.08), "criu": measured("criu", 1.5),
          "cold": measured("cold", 9.1)}
    plan = make_plan(facts(ev), policy(overlap=True), "auto", everyone_eligible(but=("sleep",)))
    assert plan.ranked_by == "downtime" and plan.attempt == "ipc"
    assert any("downtime in 0.08 s" in n and "client-seen downtime" in n for n in plan.notes)
    plan = make_plan(facts(ev), policy(), "auto", everyone_eligible(but=("sleep",)))
    assert plan.ranked_by == "time_to_ready" and plan.attempt == "criu"


def rec(served_by, t, ctx, at, first=None, recovered=False, downtime=None):
    first = first or served_by
    attempts = [{"strategy": first, "role": "primary", "ok": not recovered, "proof": {"overlap": downtime is not None}}]
    if recovered:
        attempts.append({"strategy": "cold", "role": "recovery", "ok": True})
    return {"served_by": served_by, "final_state": "serving", "via_recovery": recovered, "time_to_ready_s": t,
            "attempts": attempts, "context": ctx, "started_at": at, "finished_at": at + 1,
            "downtime": {"downtime_s": downtime} if downtime is not None else None}


CTX = {"host": "m", "engine": "reference", "engine_version": "1", "model": "d", "device": "cpu", "tp": 1}


def test_history_is_summarized_by_median_within_its_context_and_window():
    now = 1_000_000.0
    records = [rec("criu", 30.0, CTX, now - 10 * 86400),  # older than rank_max_age_h (7 days)
               rec("criu", 14.0, CTX, now - 50), rec("criu", 15.0, CTX, now - 40), rec("criu", 14.4, CTX, now - 30),
               rec("criu", 1.0, {**CTX, "model": "other"}, now - 20),  # other weights: does not count
               rec("cold", 9.1, CTX, now - 10), rec("ipc", 4.0, CTX, now - 5, downtime=0.07)]
    ev = summarize(records, CTX, policy(), NAMES, now)
    assert (ev["criu"].time_s, ev["criu"].n, ev["criu"].source) == (14.4, 3, "measured")
    assert ev["cold"].time_s == 9.1 and ev["sleep"].source == "none" and ev["sleep"].time_s is None
    assert ev["ipc"].downtime_s == 0.07
    assert summarize(records, CTX, policy(rank_runs=1), NAMES, now)["criu"].time_s == 14.4


def test_recent_failures_count_until_the_cooldown_passes():
    now = 1_000_000.0
    records = [rec("criu", 1.5, CTX, now - 500), rec("cold", 9.0, CTX, now - 300, first="criu", recovered=True),
               rec("cold", 9.0, CTX, now - 200, first="criu", recovered=True)]
    ev = summarize(records, CTX, policy(), NAMES, now)
    assert ev["criu"].failures == 2 and ev["criu"].retry_in_s == 3600 - 199  # from the last failure's end
    assert summarize(records, CTX, policy(rank_failures=3), NAMES, now)["criu"].failures == 0
    assert summarize(records, CTX, policy(), NAMES, now + 4000)["criu"].failures == 0  # cooled down: tried again
    # a success after the failures ends the streak
    records.append(rec("criu", 1.4, CTX, now - 100))
    assert summarize(records, CTX, policy(), NAMES, now)["criu"].failures == 0


def test_context_names_host_engine_weights_and_layout():
    f = facts({})
    f.service.engine_version, f.service.model_digest = "0.1.0", "abc"
    ctx = context(f, policy())
    assert ctx == {"host": "m", "engine": "reference", "engine_version": "0.1.0", "model": "abc", "device": "cpu", "tp": 1}


# ---- end to end, real processes: history makes auto pick what the fixed order would not ----------

def test_estimates_say_what_they_are_made_of(tmp_path):
    from restartkit.evidence import _estimate
    f = facts({})
    f.service.stats = {"load": {"source": "disk"}, "phases": {"ready_since_spawn": 7.8, "weight_load": 3.55}}
    assert _estimate("cold", f)[0] == 7.8 and "own cold start" in _estimate("cold", f)[1]
    t, how = _estimate("ipc", f)
    assert t == 4.35 and "minus its weight load (3.55 s) plus an attach" in how
    assert _estimate("sleep", f) is None
    # criu: a test restore first, else the snapshot's own dump, else image bytes over the read rate
    f.strategy["criu"] = {"tested_phases": {"criu_restore": 1.0, "kv_cache_restore": 0.2, "ready": 0.1, "canary": 5.0},
                          "dump_phases": {"criu_dump": 10.3, "cuda_checkpoint": 9.9, "resume": 2.8, "drop_kv_cache": 0.1}}
    assert _estimate("criu", f)[0] == 1.3
    del f.strategy["criu"]["tested_phases"]
    t, how = _estimate("criu", f)
    assert t == 23.0 and "a restore moves the same bytes back" in how
    (tmp_path / "pages-1.img").write_bytes(b"\0" * (4 << 20))
    f.strategy["criu"] = {"images_dir": str(tmp_path), "image_bytes": 4 << 20}
    t, how = _estimate("criu", f)
    assert t >= 0.12 and "GB/s this host reads them now" in how and "fixed phases of a restore" in how


def test_an_estimate_from_bytes_never_drops_below_a_restores_fixed_phases(tmp_path, monkeypatch):
    """4 MiB from a warm page cache reads in microseconds: the estimate is still what a restore costs anyway."""
    from restartkit import evidence
    monkeypatch.setattr(evidence, "read_bandwidth", lambda _images: 1e15)  # as fast as any cache could be
    f = facts({})
    f.strategy["criu"] = {"images_dir": str(tmp_path), "image_bytes": 4 << 20}
    assert evidence._estimate("criu", f)[0] == 0.12
    f.strategy["criu"]["kind"] = "weightless"
    assert evidence._estimate("criu+ipc", f)[0] == 0.17
    f.service.stats = {"load": {"source": "disk"}, "phases": {"ready_since_spawn": 0.0001}}
    assert evidence._estimate("cold", f)[0] == evidence.ESTIMATE_FLOOR_S  # never 0, whatever it is made of


def test_estimates_within_noise_keep_the_builtin_order():
    ev = {"sleep": Evidence("sleep"), "ipc": Evidence("ipc", time_s=2.1, source="estimated", detail="e"),
          "criu": Evidence("criu"), "cold": Evidence("cold", time_s=2.0, source="estimated", detail="e")}
    plan = make_plan(facts(ev), policy(), "auto", everyone_eligible(but=("sleep",)))
    assert plan.attempt == "ipc" and plan.order.index("ipc") < plan.order.index("cold")
    ev["cold"].time_s = 1.5  # clearly faster (by 0.6 s, 29 %): it overtakes
    assert make_plan(facts(ev), policy(), "auto", everyone_eligible(but=("sleep",))).attempt == "cold"


def test_a_restart_that_went_straight_to_recovery_is_no_failure_of_cold():
    """criu asked for by name while it was not eligible: the record holds a skipped criu and a cold
    recovery.  Neither counts against cold (it served) nor as a criu run."""
    now = 10_000.0
    straight = {"served_by": "cold", "final_state": "serving", "via_recovery": True, "time_to_ready_s": 2.0,
                "context": CTX, "started_at": now - 100, "finished_at": now - 99,
                "attempts": [{"strategy": "criu", "role": "primary", "ok": False, "skipped": True},
                             {"strategy": "cold", "role": "recovery", "ok": True}]}
    ev = summarize([straight] * 3, CTX, policy(rank_failures=2), NAMES, now)
    assert ev["cold"].failures == 0 and ev["criu"].failures == 0 and ev["cold"].source == "none"


def test_records_of_another_service_do_not_count():
    now = 10_000.0
    theirs = {**rec("sleep", 9.0, CTX, now - 100, recovered=True), "service": "other"}
    ev = summarize([theirs] * 3, CTX, policy(rank_failures=2), NAMES, now)
    assert ev["sleep"].failures == 0
    mine = {**theirs, "service": "s"}
    assert summarize([mine] * 3, CTX, policy(rank_failures=2), NAMES, now)["sleep"].failures == 3
