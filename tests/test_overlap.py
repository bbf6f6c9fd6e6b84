"""Overlapped ipc restart under client load: the new engine prepares while
the old one serves, takes the port beside it, and only then is the old one
stopped.  No wrong answers, downtime measured; a new engine that fails to
prepare leaves the old one serving."""
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture
def overlap_service(make_policy, tmp_path, service_cleanup):
    sockdir = tmp_path / "sockets"
    sockdir.mkdir(mode=0o700)
    policy = make_policy(extra=f'\n[ipc]\nsocket_dir = "{sockdir}"\nfallback = false\nstate_timeout_s = 2.0\n')
    policy.write_text(policy.read_text().replace("[restart]\n", "[restart]\noverlap = true\n"))
    launcher = subprocess.Popen([sys.executable, "-m", "restartkit.cli", "preload", "--policy", str(policy)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:  # the launcher goes whatever happens, a failed setup included
        assert run_cli("preload", "--policy", policy, "--wait-ready", "--startup-timeout", "60").returncode == 0
        service_cleanup(policy)
        assert run_cli("start", "--policy", policy).returncode == 0
        yield policy, launcher
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(15)


class Hammer(threading.Thread):
    """A client asking the same greedy question over and over."""

    def __init__(self, port):
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.results = []  # (time, kind, tokens, engine)
        self.stop = threading.Event()

    def run(self):
        body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}).encode()
        while not self.stop.is_set():
            t = time.monotonic()
            req = urllib.request.Request(self.url, data=body, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=2.0) as r:
                    out = json.loads(r.read())
                self.results.append((t, "ok", out["choices"][0]["token_ids"], out["system_fingerprint"]))
            except urllib.error.HTTPError as e:
                self.results.append((t, f"http {e.code}", None, None))
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                kind = "timeout" if "timed out" in str(reason) else "connection"
                self.results.append((t, kind, None, None))
            time.sleep(0.01)


def port_of(policy):
    return int(policy.read_text().split("port = ")[1].split()[0])


def test_overlapped_restart_under_load(overlap_service):
    policy, _ = overlap_service
    old_pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    hammer = Hammer(port_of(policy))
    hammer.start()
    time.sleep(0.5)
    r = run_cli("restart", "--policy", policy, "--strategy", "ipc", "--strict", "--json")
    time.sleep(0.5)
    hammer.stop.set()
    hammer.join(5)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(r.stdout)
    proof = rec["attempts"][0]["proof"]
    assert rec["served_by"] == "ipc" and proof["overlap"] and proof["ipc"] == "hit"
    assert proof["old_pid"] == old_pid and proof["new_pid"] != old_pid
    assert rec["proof"]["canary_identical"] is True
    assert rec["downtime"]["downtime_s"] is not None and rec["downtime"]["answered"] > 0
    answers = [x for x in hammer.results if x[1] == "ok"]
    assert len({tuple(x[2]) for x in answers}) == 1, "a wrong answer"  # every answer the same tokens
    assert not [x for x in hammer.results if x[1] == "timeout"], "a request hung past the client's timeout"
    assert {x[1] for x in hammer.results} <= {"ok", "connection", "http 503"}
    engines = [x[3] for x in answers]
    assert engines[0] == f"restartkit-ref-{old_pid}" and engines[-1] == f"restartkit-ref-{proof['new_pid']}"
    ok_times = [x[0] for x in answers]
    client_downtime = max(b - a for a, b in zip(ok_times, ok_times[1:]))
    assert client_downtime < 1.0, client_downtime  # the port never closed: only request spacing shows
    status = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert status["serving"] and status["pid"] == proof["new_pid"]


def test_a_new_engine_that_fails_to_prepare_leaves_the_old_one_serving(overlap_service):
    policy, launcher = overlap_service
    old_pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    from restartkit.planner import make_plan
    from restartkit.restart import gather_facts
    from restartkit.service import Service
    from restartkit.strategies import all_strategies
    svc = Service.from_policy_file(policy)
    facts = gather_facts(svc, "restart")
    plan = make_plan(facts, svc.policy, "ipc", all_strategies(), overlap=True)
    assert plan.verdicts["ipc"].eligible and plan.overlap
    # the fault: the weight cache goes away after the plan; fallback is off, so the new engine cannot prepare
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(15)
    out = all_strategies()["ipc"].execute(svc, facts, plan)
    assert not out.ok and out.old_still_serving
    assert "before the old one was stopped" in out.error and "fallback is off" in out.error
    status = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert status["serving"] and status["pid"] == old_pid  # the old engine never stopped


def test_prestarted_restart_activates_after_the_old_engine_stopped(overlap_service):
    """Not enough memory for a second KV cache (forced here): the new engine prepares beside the
    old one, which then stops; only then does the new one allocate, warm up and take the port."""
    policy, _ = overlap_service
    policy.write_text(policy.read_text().replace("[restart]\n", '[restart]\noverlap_mode = "prestart"\n'))
    old_pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    r = run_cli("restart", "--policy", policy, "--strategy", "ipc", "--strict", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(r.stdout)
    a = rec["attempts"][0]
    assert rec["served_by"] == "ipc" and a["proof"]["overlap_mode"] == "prestart" and a["proof"]["ipc"] == "hit"
    assert rec["proof"]["canary_identical"] is True and a["proof"]["new_engine_canary"] == rec["proof"]["after"][:1]
    ph = a["phases"]
    # the process start happened while the old engine served: the downtime is the stop and the activation
    assert ph["stop_old"] <= ph["stop_to_ready"] < a["engine_phases"]["ready_since_spawn"]
    assert "early_warmup" in a["engine_phases"]  # the first forward pass ran before the old engine stopped
    prom = (policy.parent / "state" / "svc" / "metrics.prom").read_text()
    assert f'restartkit_downtime_seconds{{service="svc",strategy="ipc"}} {rec["downtime"]["downtime_s"]}' in prom
    assert rec["downtime"]["downtime_s"] is not None and rec["downtime"]["downtime_s"] < a["engine_phases"]["ready_since_spawn"]
    status = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert status["serving"] and status["pid"] == a["proof"]["new_pid"] != old_pid
