"""A real reference engine, restarted cold through the CLI: records, proof,
exit codes, and the errors a user meets (port in use, missing model, a crash)."""
import json
from pathlib import Path
import socket
import time

import pytest

from tests.helpers import prom_sample, run_cli

pytestmark = pytest.mark.slow


def start(policy, cleanup):
    cleanup(policy)
    r = run_cli("start", "--policy", policy, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_cold_restart_is_proven_by_an_identical_canary(make_policy, service_cleanup):
    policy = make_policy()
    first = start(policy, service_cleanup)
    r = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["final_state"] == "serving" and rec["served_by"] == "cold" and not rec["via_recovery"]
    assert rec["proof"]["canary_identical"] is True
    assert rec["proof"]["baseline_source"] == "live engine before the restart"
    assert rec["proof"]["before"] == rec["proof"]["after"] and len(rec["proof"]["after"][0]) == 8
    attempt = rec["attempts"][0]
    # a hand-over: the old engine stopped listening ("stop"), the new one started at once, and
    # waited for the old one's exit ("old_exit") before it allocated memory ("wait_previous")
    assert set(attempt["phases"]) == {"stop", "start_to_ready", "old_exit"}
    assert attempt["phases"]["stop"] <= attempt["phases"]["old_exit"]
    assert {"import_torch", "wait_previous", "weight_load", "kv_cache_alloc", "warmup"} <= set(attempt["engine_phases"])
    assert rec["time_to_ready_s"] > 0
    status = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert status["serving"] and status["pid"] != first["pid"]
    # the record is in the history, and the metrics count it
    hist = json.loads(run_cli("history", "--policy", policy, "--json").stdout)["records"]
    assert hist[-1]["id"] == rec["id"]
    prom = (policy.parent / "state" / "svc" / "metrics.prom").read_text()
    assert prom_sample(prom, "restartkit_restart_total", service="svc", strategy="cold", outcome="ok") == 1
    assert prom_sample(prom, "restartkit_last_time_to_ready_seconds", service="svc", strategy="cold") > 0


def test_the_engine_says_when_it_is_ready_and_keeps_no_pipe(make_policy, service_cleanup):
    """The reference engine writes its ready byte on restartkit's pipe, so the wait ends with one
    probe after the signal instead of a probe every 50 ms; then it closes the pipe (a CRIU
    snapshot of it must not hold a pipe to a process outside it)."""
    import os
    policy = make_policy()
    out = start(policy, service_cleanup)
    assert out["readiness"]["signalled"] is True
    # one probe at once, one a second while it starts (polling would send 20 a second), one after the signal
    assert 1 <= out["readiness"]["probes"] <= 2 + out["ready_s"]
    pipes = [os.readlink(f"/proc/{out['pid']}/fd/{fd}") for fd in os.listdir(f"/proc/{out['pid']}/fd")]
    assert not [p for p in pipes if p.startswith("pipe:")], pipes


def test_openai_client_is_token_identical_across_a_restart(make_policy, service_cleanup):
    openai = pytest.importorskip("openai")
    policy = make_policy()
    start(policy, service_cleanup)
    port = int(policy.read_text().split("port = ")[1].split()[0])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    model = client.models.list().data[0].id

    def ask():
        c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
        return c.choices[0].text, c.choices[0].model_extra["token_ids"]

    before = ask()
    assert len(before[1]) == 12
    r = run_cli("restart", "--policy", policy, "--strategy", "cold")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ask() == before


def test_auto_falls_to_cold_and_plan_lists_every_strategy(make_policy, service_cleanup):
    policy = make_policy()
    start(policy, service_cleanup)
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert sorted(s["strategy"] for s in plan["strategies"]) == sorted(["sleep", "standby", "criu+ipc", "ipc", "criu", "cold"])
    assert plan["order"][:2] == ["sleep", "standby"]  # not measured here: the built-in order's places
    assert plan["attempt"] == "cold"
    assert all(s["reasons"] for s in plan["strategies"] if not s["eligible"])


@pytest.mark.parametrize("args", [["--strategy", "ipc"], ["--strategy", "ipc", "--strict"],
                                  ["--strategy", "standby"], ["--strategy", "criu", "--strict"],
                                  ["--strategy", "cold", "--overlap"]])
def test_a_named_strategy_that_cannot_run_is_refused_before_anything_is_touched(make_policy, service_cleanup, args):
    """Once, these restarted cold and exited 0 (or 3): a success the operator did not ask for.  Now: exit 2,
    every reason, what would make it run, and the serving engine untouched (same PID, no record)."""
    policy = make_policy()
    start(policy, service_cleanup)
    before = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    r = run_cli("restart", "--policy", policy, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "nothing was touched" in r.stderr and "Traceback" not in r.stderr, r.stderr
    if "--overlap" in args:
        assert "--overlap applies to ipc and standby restarts only" in r.stderr, r.stderr
    else:
        assert f"{args[1]} cannot run now" in r.stderr and f"restartkit plan --policy {policy}" in r.stderr, r.stderr
    after = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert after["serving"] and after["pid"] == before["pid"] and after["last_restart"] == before["last_restart"]


def test_port_in_use_is_named(make_policy, service_cleanup):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        policy = make_policy(port=port)
        service_cleanup(policy)
        r = run_cli("start", "--policy", policy)
    assert r.returncode == 1
    assert f"port {port} is already in use" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_directory(make_policy, tmp_path, service_cleanup):
    policy = make_policy(model=str(tmp_path / "nowhere"))
    service_cleanup(policy)
    r = run_cli("start", "--policy", policy)
    assert r.returncode == 1 and "does not exist" in r.stderr and "model create" in r.stderr
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert plan["attempt"] is None
    r = run_cli("restart", "--policy", policy, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["final_state"] == "not serving"


def test_engine_that_crashes_during_start(make_policy, tmp_path, service_cleanup, tiny_model):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    first = sorted(broken.glob("*.safetensors"))[0]
    first.write_bytes(first.read_bytes()[:100])  # truncated shard
    policy = make_policy(model=str(broken))
    service_cleanup(policy)
    t0 = time.monotonic()
    r = run_cli("start", "--policy", policy)
    assert r.returncode == 1
    assert "exited with code 1 while starting" in r.stderr and "Traceback" not in r.stderr
    assert "start failed" in r.stderr  # the engine's own last words are shown
    assert time.monotonic() - t0 < 30  # it gave up at once, no waiting for the deadline


def test_bad_policy_is_exit_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[service]\nname = "x"\nmodel = "/m"\nport = "eighty"\n')
    for cmd in (["policy", "check", bad], ["plan", "--policy", bad], ["restart", "--policy", bad]):
        r = run_cli(*cmd)
        assert r.returncode == 2, cmd
        assert "[service.port]" in r.stderr and "must be an integer" in r.stderr and "Traceback" not in r.stderr


def test_help_is_fast_and_does_not_import_torch():
    import subprocess
    import sys
    code = "import sys, time; t=time.perf_counter(); sys.argv=['restartkit','--help'];\n" \
           "from restartkit.cli import main\ntry: main()\nexcept SystemExit: pass\n" \
           "print('TORCH' if 'torch' in sys.modules else 'NOTORCH', time.perf_counter()-t, file=sys.stderr)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "NOTORCH" in r.stderr, r.stderr
    for cmd in (["facts", "--json"], ["plan", "--help"], ["plan", "--policy", "policies/demo.toml", "--json"]):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "restartkit.cli", *cmd], capture_output=True,
                             text=True, cwd=str(Path(__file__).resolve().parent.parent))
        assert " torch\n" not in out.stderr and "| torch\n" not in out.stderr, cmd


def test_a_new_engine_waits_for_the_one_it_replaces(monkeypatch):
    import subprocess
    import time

    import psutil

    from restartkit.reference.serving.handover import wait_for_previous_engine
    old = subprocess.Popen(["sleep", "0.6"])
    ctime = psutil.Process(old.pid).create_time()
    monkeypatch.setenv("RESTARTKIT_AFTER_PID", f"{old.pid}:{ctime}")
    t0 = time.monotonic()
    assert wait_for_previous_engine() >= 0.4 and time.monotonic() - t0 < 5
    old.wait()
    # a PID now used by another process (another start time) is not waited for
    other = subprocess.Popen(["sleep", "30"])
    try:
        monkeypatch.setenv("RESTARTKIT_AFTER_PID", f"{other.pid}:{ctime - 100}")
        assert wait_for_previous_engine() < 0.1  # (the time the check itself took)
        # one that does not exit in time stops the start, saying why
        monkeypatch.setenv("RESTARTKIT_AFTER_PID", f"{other.pid}:{psutil.Process(other.pid).create_time()}")
        monkeypatch.setenv("RESTARTKIT_AFTER_TIMEOUT_S", "0.3")
        with pytest.raises(TimeoutError, match=f"PID {other.pid}"):
            wait_for_previous_engine()
    finally:
        other.kill()
        other.wait()


STUBBORN = """
import http.server, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)
        self.end_headers()
    do_POST = do_GET
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("up", flush=True)
srv.serve_forever()
"""


def test_an_engine_that_ignores_sigterm_is_killed_and_replaced(make_policy, service_cleanup):
    """The fault: the running engine ignores SIGTERM and keeps its port.  The restart waits the stop
    timeout, kills it, and only then starts the new engine on that port."""
    import subprocess
    import sys

    from restartkit.policy import load_policy
    from restartkit.service import Service
    policy = make_policy()
    policy.write_text(policy.read_text().replace("stop_timeout_s = 10", "stop_timeout_s = 1"))
    service_cleanup(policy)
    port = int(policy.read_text().split("port = ")[1].split()[0])
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout.readline().strip() == "up"
        Service(load_policy(policy)).engine.adopt(stubborn.pid, "cold")  # restartkit takes it for its engine
        r = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        rec = json.loads(r.stdout)
        assert rec["final_state"] == "serving" and rec["served_by"] == "cold"
        assert rec["attempts"][0]["phases"]["stop"] >= 1.0  # waited the stop timeout, then killed
        assert stubborn.wait(timeout=10) == -9
    finally:
        if stubborn.poll() is None:
            stubborn.kill()


def test_a_restart_after_the_weights_changed_on_disk_serves_them_and_says_so(make_policy, service_cleanup, tmp_path,
                                                                               tiny_model):
    """The weights were replaced on disk while the engine served the old ones: a plain restart serves
    the new ones, and that is no failure (it said "not serving", exit 1, while serving the new weights)."""
    import shutil
    from restartkit.reference.model.checkpoint import write_checkpoint
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    policy = make_policy(model=str(model))
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    other = write_checkpoint(tmp_path / "other", "tiny", seed=7)
    for f in other.glob("*.safetensors"):
        shutil.copy(f, model / f.name)
    r = run_cli("restart", "--policy", policy, "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["final_state"] == "serving" and not rec["via_recovery"], rec
    assert any("weights on disk changed" in n for n in rec["plan"]["notes"]), rec["plan"]["notes"]
    assert rec["proof"].get("canary_identical") is None  # not compared: new weights answer otherwise
    again = json.loads(run_cli("restart", "--policy", policy, "--json").stdout)  # the engine now serves what is on disk
    assert again["proof"]["canary_identical"] is True and not any("weights on disk" in n for n in again["plan"]["notes"])


def test_status_after_a_crash_names_the_command_that_brings_it_back(make_policy, service_cleanup):
    import os
    import signal
    policy = make_policy()
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    os.kill(pid, signal.SIGKILL)
    r = run_cli("status", "--policy", policy, "--json")
    st = json.loads(r.stdout)
    assert r.returncode != 0 and not st["serving"]
    assert st["next"].startswith(f"restartkit start --policy {policy}")
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"] is None  # status started nothing
