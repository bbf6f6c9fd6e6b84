"""The planner is pure: facts and policy built here, no processes, no sleeping."""
from restartkit.facts import CriuFacts
from restartkit.planner import make_plan, render_plan
from restartkit.policy import parse_policy
from restartkit.strategies import all_strategies
from restartkit.contracts import Facts, ServiceFacts
from tests.helpers import Always, host


def facts(reason="restart", **kw) -> Facts:
    return Facts(host=host(**kw), service=ServiceFacts(engine="reference", engine_running=True, engine_ready=True), reason=reason)


def policy(**service):
    return parse_policy({"service": {"name": "s", "model": "/m", **service}})


def test_auto_runs_the_first_eligible_in_the_default_order():
    strategies = {"sleep": Always("sleep", ok=False), "ipc": Always("ipc"), "criu": Always("criu"), "cold": Always("cold")}
    plan = make_plan(facts(), policy(), "auto", strategies)
    assert plan.attempt == "ipc"
    assert plan.order == ["sleep", "ipc", "criu", "cold"]
    # every failed reason is kept, not just the first
    assert plan.verdicts["sleep"].reasons == ["sleep says no", "sleep says no twice"]


def test_a_criu_plan_says_when_its_snapshot_was_never_test_restored():
    strategies = {n: Always(n) for n in ("sleep", "ipc", "criu", "cold")}
    f = facts()
    f.strategy["criu"] = {"current": "20261130-1", "tested": None}
    plan = make_plan(f, policy(), "criu", strategies)
    assert any("20261130-1 has never been test-restored" in n for n in plan.notes), plan.notes
    f.strategy["criu"]["tested"] = True
    assert not any("test-restored" in n for n in make_plan(f, policy(), "criu", strategies).notes)
    f.strategy["criu"]["tested"] = None  # not a criu restart: nothing to say
    assert not any("test-restored" in n for n in make_plan(f, policy(), "ipc", strategies).notes)


def test_auto_respects_the_policy_order():
    strategies = {n: Always(n) for n in ("sleep", "ipc", "criu", "cold")}
    p = parse_policy({"service": {"name": "s", "model": "/m"}, "restart": {"strategies": ["criu", "ipc"]}})
    plan = make_plan(facts(), p, "auto", strategies)
    assert plan.attempt == "criu"
    assert plan.order[:2] == ["criu", "ipc"] and set(plan.order) == set(strategies)


def test_a_forced_ineligible_strategy_goes_straight_to_recovery():
    strategies = {"sleep": Always("sleep"), "ipc": Always("ipc"), "criu": Always("criu", ok=False), "cold": Always("cold")}
    plan = make_plan(facts(), policy(), "criu", strategies)
    assert plan.attempt == "cold" and plan.goes_straight_to_recovery
    assert any("not eligible" in n for n in plan.notes)


def test_nothing_can_run_when_cold_cannot():
    strategies = {n: Always(n, ok=False) for n in ("sleep", "ipc", "criu", "cold")}
    plan = make_plan(facts(), policy(), "auto", strategies)
    assert plan.attempt is None
    assert "nothing can run" in render_plan(plan)


def test_real_registry_explains_each_strategy():
    plan = make_plan(facts(), policy(), "auto", all_strategies())
    assert any("without sleep mode" in r for r in plan.verdicts["sleep"].reasons)
    assert plan.verdicts["criu"].built and any("no snapshot yet" in r for r in plan.verdicts["criu"].reasons)
    assert plan.verdicts["ipc"].built and not plan.verdicts["ipc"].eligible


def test_ipc_reasons_name_the_daemon_and_the_fields():
    f = facts()
    f.strategy["ipc"] = {"daemons": [{"device_uuid": "cpu-x-rank0", "state": "absent"}], "expected": []}
    reasons = all_strategies()["ipc"].check(f, policy()).reasons
    assert any("restartkit preload" in r for r in reasons)
    fp = {"checkpoint": "a", "dtype": "float32"}
    f.strategy["ipc"] = {"daemons": [{"device_uuid": "GPU-1", "state": "ready", "fingerprint": fp}],
                              "expected": [{**fp, "dtype": "bfloat16"}]}
    reasons = all_strategies()["ipc"].check(f, policy()).reasons
    assert reasons == ["the daemon holds other weights than the engine wants: GPU-1: dtype differs (daemon 'float32', engine 'bfloat16')"]
    # asked for by name with fallback on, the engine falls back itself: forceable; auto still goes cold
    assert all_strategies()["ipc"].check(f, policy()).forceable
    assert make_plan(f, policy(), "ipc", all_strategies()).attempt == "ipc"
    assert make_plan(f, policy(), "auto", all_strategies()).attempt == "cold"
    strict = parse_policy({"service": {"name": "s", "model": "/m"}, "ipc": {"fallback": False}})
    assert not all_strategies()["ipc"].check(f, strict).forceable
    assert make_plan(f, strict, "ipc", all_strategies()).attempt == "cold"
    p = parse_policy({"service": {"name": "s", "model": "/m", "engine_args": ["--enable-sleep-mode"]}})
    assert any("sleep mode" in r for r in all_strategies()["ipc"].check(f, p).reasons)


def test_criu_prerequisites_each_give_a_reason():
    f = facts(arch="aarch64", uid=1000, user="ann", passwordless_sudo=False, io_uring_disabled=0,
              criu=CriuFacts(path="/usr/sbin/criu", source="PATH", version="3.17.1", check_ok=False, check_output="vdso"))
    p = policy(tensor_parallel_size=2, engine="vllm", model="org/model")  # a hub id: its revision must be pinned
    reasons = " | ".join(all_strategies()["criu"].check(f, p).reasons)
    for words in ("x86-64", "passwordless sudo", "tensor_parallel_size = 2", "is too old: 4.0 or newer",
                  "io_uring_disabled=2", "40-character", "no snapshot yet"):
        assert words in reasons, words


def test_criu_missing_binary_names_the_installer():
    f = facts(criu=CriuFacts(path=None, source="not found in RESTARTKIT_CRIU, /opt/restartkit/criu or PATH"))
    reasons = all_strategies()["criu"].check(f, policy()).reasons
    assert any("scripts/install-criu" in r for r in reasons)


def test_sleep_cannot_apply_new_code_and_says_so():
    f = facts(reason="code")
    f.service.stats = {"sleep": {"enabled": True}, "weight_bytes": 10}
    f.strategy["sleep"] = {"state": {"enabled": True, "asleep": False}}
    reasons = all_strategies()["sleep"].check(f, policy()).reasons
    assert reasons == ["the restart is for new code: a sleep cycle keeps the process, so it applies no new code, flags or weights"]
    f = facts(reason="restart", mem_available_bytes=5)
    f.service.stats = {"sleep": {"enabled": True}, "weight_bytes": 10, "load": {"source": "ipc", "mode": "zero_copy"}}
    f.strategy["sleep"] = {"state": {"enabled": True, "asleep": False}}
    reasons = " | ".join(all_strategies()["sleep"].check(f, policy()).reasons)
    assert "zero_copy" in reasons and "level 1 parks" in reasons


def test_the_planner_is_pure():
    """Facts built once; then planning (every real strategy's check, the overlap decision, the
    notes) and rendering run with sockets, HTTP, file opens, stat, processes and sleeping made
    to raise.  A predicate that asks the world instead of the gathered facts fails here."""
    import builtins
    import contextlib
    import http.client
    import io
    import os
    import socket
    import subprocess
    import time
    import urllib.request

    import restartkit.weightcache.fingerprint  # noqa: F401  (imported by a predicate: loaded before, as in a command)

    f = facts()
    f.service.stats = {"sleep": {"enabled": True}, "weight_bytes": 10, "reuse_port": True}
    f.service.engine_notes = ["an engine note"]
    f.strategy = {"sleep": {"engine_problem": None, "state": {"enabled": True, "asleep": False}},
                  "ipc": {"engine_problem": None,
                          "daemons": [{"device_uuid": "cpu-x-rank0", "state": "ready", "fingerprint": {"dtype": "f"}}],
                          "expected": [{"dtype": "f"}]},
                  "criu": {"model_local": True, "current": "20261130-1", "tested": None, "mismatches": [],
                           "identity": {"python": "3.11"}}}
    p = parse_policy({"service": {"name": "s", "model": "/m", "host": "0.0.0.0"},
                      "restart": {"overlap": True}, "sleep": {"enabled": True}, "ipc": {"mode": "copy"}})

    def forbidden(*_a, **_k):
        raise AssertionError("I/O while planning")
    targets = [(socket, "socket"), (socket, "create_connection"), (builtins, "open"), (io, "open"), (os, "open"),
               (os, "stat"), (os, "lstat"), (os, "listdir"), (os, "scandir"), (os, "kill"), (subprocess, "Popen"),
               (subprocess, "run"), (urllib.request, "urlopen"), (http.client.HTTPConnection, "request"),
               (time, "sleep")]
    strategies = all_strategies()
    with contextlib.ExitStack() as stack:
        for obj, name in targets:
            original = getattr(obj, name)
            setattr(obj, name, forbidden)
            stack.callback(setattr, obj, name, original)
        with __import__("pytest").raises(AssertionError):
            os.stat("/")  # the trap works
        plans = {req: make_plan(f, p, req, strategies) for req in ("auto", "ipc", "criu", "cold")}
        assert not make_plan(f, p, "ipc", strategies, overlap=False).overlap  # the command line wins
        text = render_plan(plans["auto"])
    assert plans["auto"].attempt == "sleep" and plans["auto"].overlap_dropped  # overlap is for ipc only
    assert plans["ipc"].overlap and not plans["cold"].overlap
    assert any("never been test-restored" in n for n in plans["criu"].notes)
    assert "an engine note" in text and "host binds 0.0.0.0" in text


def test_a_model_path_that_is_not_there_is_not_called_a_hub_id():
    f = facts()
    reasons = " | ".join(all_strategies()["criu"].check(f, policy(engine="vllm", model="/srv/absent")).reasons)
    assert "hub id" not in reasons, reasons
    assert "hub id" in " | ".join(all_strategies()["criu"].check(f, policy(engine="vllm", model="org/m")).reasons)
