"""restartkit's units under a real systemd (252, booted as PID 1 in a container: tests/booted.py), installed with the
CLI the way the docs tell an operator to and left unedited: socket activation, Type=notify, the watchdog, a SIGKILLed
engine under load, a SIGKILL of the whole unit, `systemctl reload` waiting for its restart, a clean stop, a unit for
another user, the refresh timer with CRIU inside, and the engine's lines in the journal."""
import json

import pytest

from tests.booted import PYTHON, RESTARTKIT, Booted, why_not

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.skipif(why_not() is not None, reason=why_not() or "")]

MODEL = "/srv/restartkit/models/tiny"
POLICY = """\
[service]
name = "{name}"
engine = "reference"
model = "{model}"
port = {port}
max_model_len = 256
engine_args = ["--threads", "1"]

[restart]
strategies = {strategies}
start_timeout_s = 120
stop_timeout_s = 15
{extra}"""
LOAD = f"""\
import json, os, signal, sys, time
sys.path.insert(0, "/opt/restartkit/src")
from restartkit.clients import ClientLoad, summarize
port, pid_cmd = int(sys.argv[1]), sys.argv[2]
load = ClientLoad("127.0.0.1", port, None, clients=4, max_tokens=4).start()
time.sleep(3)
kill = time.monotonic()
os.system(pid_cmd)
time.sleep(12)
load.stop()
got = summarize(load.snapshot(), [kill], clients=4)
print(json.dumps({{"refused": got["refused"], "http_5xx": got["http_5xx"], "ok": got["counts"].get("ok", 0),
                  "answers": len({{tuple(a) for a in load.answers}})}}))
"""


def policy(c: Booted, name: str, port: int, strategies='["standby", "ipc", "cold"]', extra: str = "") -> str:
    path = f"/etc/restartkit/{name}.toml"
    c.write(path, POLICY.format(name=name, model=MODEL, port=port, strategies=strategies, extra=extra))
    return path


def complete(c: Booted, port: int, timeout: float = 120) -> dict:
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0})
    r = c.run(["curl", "-sS", "--fail-with-body", "-m", str(timeout), "-H", "Content-Type: application/json",
               "-d", body, f"http://127.0.0.1:{port}/v1/completions"])
    return json.loads(r.stdout)


def journal(c: Booted, unit: str) -> str:
    return c.run(["journalctl", "-u", unit, "--no-pager", "-o", "cat"]).stdout


@pytest.fixture(scope="module")
def booted():
    c = Booted()
    try:
        c.prepare().boot()
        c.run([RESTARTKIT, "model", "create", "--preset", "tiny", "--out", MODEL])
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def svc(booted):
    """The service `svc` installed as the docs say (its unit and its socket, watchdog on), not started."""
    c = booted
    path = policy(c, "svc", 8311)
    out = c.run([RESTARTKIT, "supervise", "--policy", path, "--install-unit", "--watchdog-sec", "10"]).stdout
    assert "wrote /etc/systemd/system/restartkit-svc.service" in out, out
    c.run(["systemctl", "daemon-reload"])
    return {"c": c, "policy": path, "port": 8311, "unit": "restartkit-svc.service"}


def serving_pid(c: Booted, policy_path: str) -> int:
    st = json.loads(c.run([RESTARTKIT, "status", "--policy", policy_path, "--json"], check=False).stdout or "{}")
    return st.get("pid") if st.get("serving") else 0


def test_socket_activation_the_first_connection_starts_the_service_and_is_answered(svc):
    c = svc["c"]
    c.run(["systemctl", "start", "restartkit-svc.socket"])
    assert c.show(svc["unit"], "ActiveState")["ActiveState"] == "inactive"
    answer = complete(c, svc["port"])  # waits in the socket's queue while the unit starts
    assert answer["choices"][0]["text"] is not None and answer["usage"]["completion_tokens"] >= 1
    # READY=1 follows supervise's own canary, a moment after the engine's first answer
    c.wait(lambda: c.show(svc["unit"], "ActiveState")["ActiveState"] == "active", timeout=60)
    svc["canary"] = answer["choices"][0]["text"]


def test_type_notify_is_active_only_once_it_serves(svc):
    c = svc["c"]
    c.run(["systemctl", "stop", svc["unit"]])
    c.run(["systemctl", "start", "--no-block", svc["unit"]])
    seen = []

    def active():
        state = c.show(svc["unit"], "ActiveState")["ActiveState"]
        seen.append(state)
        return state == "active"
    c.wait(active, timeout=120, every=0.1)
    assert "activating" in seen, seen  # READY=1 came after the start, not with it
    assert complete(c, svc["port"], timeout=5)["choices"][0]["text"] == svc["canary"]  # active means serving
    assert "serving" in c.show(svc["unit"], "StatusText")["StatusText"]


def test_a_sigkilled_engine_under_load_refuses_nothing_and_answers_the_same(svc):
    c = svc["c"]
    pid = serving_pid(c, svc["policy"])
    assert pid
    c.write("/root/load.py", LOAD)
    out = c.run([PYTHON, "/root/load.py", str(svc["port"]), f"kill -9 {pid}"], timeout=120).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["refused"] == 0 and got["http_5xx"] == 0 and got["ok"] > 5 and got["answers"] == 1, got
    c.wait(lambda: serving_pid(c, svc["policy"]) not in (0, pid), timeout=60)
    assert c.show(svc["unit"], "ActiveState")["ActiveState"] == "active"


def test_systemctl_kill_sigkill_of_the_whole_unit_comes_back(svc):
    c = svc["c"]
    before = c.show(svc["unit"], "MainPID", "NRestarts")
    c.run(["systemctl", "kill", "-s", "SIGKILL", svc["unit"]])
    c.wait(lambda: (s := c.show(svc["unit"], "MainPID", "NRestarts", "ActiveState"))["ActiveState"] == "active"
           and s["MainPID"] not in ("0", before["MainPID"]), timeout=120)
    assert int(c.show(svc["unit"], "NRestarts")["NRestarts"]) == int(before["NRestarts"]) + 1
    assert complete(c, svc["port"])["choices"][0]["text"] == svc["canary"]


def test_systemctl_reload_returns_when_the_planned_restart_is_done(svc):
    c = svc["c"]
    before = serving_pid(c, svc["policy"])
    r = c.run(["systemctl", "reload", svc["unit"]], check=False)
    assert r.returncode == 0, r.stdout + r.stderr + journal(c, svc["unit"])[-3000:]
    after = serving_pid(c, svc["policy"])  # no wait: the restart is done when reload returns
    assert after and after != before, (before, after)
    last = json.loads(c.run([RESTARTKIT, "history", "--policy", svc["policy"], "--last", "1", "--json"]).stdout)
    rec = last["records"][-1]
    assert rec["trigger"]["what"] == "SIGHUP" and rec["final_state"] == "serving", rec
    assert "reloaded: serving by" in journal(c, svc["unit"])
    assert complete(c, svc["port"], timeout=5)["choices"][0]["text"] == svc["canary"]


def test_the_watchdog_restarts_a_stopped_supervise(svc):
    c = svc["c"]
    before = c.show(svc["unit"], "MainPID", "NRestarts")
    c.run(["kill", "-STOP", before["MainPID"]])
    c.wait(lambda: (s := c.show(svc["unit"], "MainPID", "ActiveState"))["ActiveState"] == "active"
           and s["MainPID"] not in ("0", before["MainPID"]), timeout=150)
    assert int(c.show(svc["unit"], "NRestarts")["NRestarts"]) > int(before["NRestarts"])
    assert "Watchdog timeout" in c.run(["journalctl", "-u", svc["unit"], "--no-pager"]).stdout
    assert complete(c, svc["port"])["choices"][0]["text"] == svc["canary"]


def test_the_journal_holds_supervises_lines_and_the_engines(svc):
    text = journal(svc["c"], svc["unit"])
    assert "svc: starting the engine" in text or "svc: PID" in text, text[-2000:]
    assert any(line.startswith("engine: ") for line in text.splitlines()), text[-2000:]


def test_systemctl_stop_is_clean(svc):
    c = svc["c"]
    c.run(["systemctl", "stop", svc["unit"], "restartkit-svc.socket"])
    s = c.show(svc["unit"], "ActiveState", "Result", "MainPID")
    assert s["ActiveState"] == "inactive" and s["Result"] == "success" and s["MainPID"] == "0", s
    assert c.run(["pgrep", "-f", "restartkit"], check=False).stdout == ""
    assert c.run(["ls", "-A", "/dev/shm"]).stdout.split() == []


def test_a_unit_for_another_user_runs_as_that_user(booted):
    c = booted
    c.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "rkuser"], check=False)
    # a model the user cannot read is refused at install, naming the file (the unit would fail in its start)
    c.sh(f"cp -a {MODEL} /srv/restartkit/models/private && chmod 600 /srv/restartkit/models/private/*.safetensors")
    c.write("/etc/restartkit/private.toml", POLICY.format(name="private", model="/srv/restartkit/models/private",
                                                          port=8319, strategies='["cold"]', extra=""))
    r = c.run([RESTARTKIT, "supervise", "--policy", "/etc/restartkit/private.toml", "--install-unit", "--user",
               "rkuser"], check=False)
    assert r.returncode == 2 and "rkuser (the unit's user) cannot read the model" in r.stderr, r.stderr
    path = policy(c, "other", 8312, strategies='["ipc", "cold"]')
    out = c.run([RESTARTKIT, "supervise", "--policy", path, "--install-unit", "--user", "rkuser"]).stdout
    assert "sudo -u rkuser restartkit status --state-dir /var/lib/restartkit" in out, out
    c.run(["systemctl", "daemon-reload"])
    c.run(["systemctl", "start", "restartkit-other.socket", "restartkit-other.service"], timeout=200)
    assert complete(c, 8312)["usage"]["completion_tokens"] >= 1
    procs = [ln.split(None, 1) for ln in c.run(["ps", "-eo", "user=,args="]).stdout.splitlines()
             if "/etc/restartkit/other.toml" in ln or "--port 18312" in ln or "restartkit.front" in ln]
    # supervise, its front (on 8312, systemd's socket) and its engine (behind the front, on 18312)
    assert len(procs) >= 3 and {user for user, _ in procs} == {"rkuser"}, procs
    assert c.run(["stat", "-c", "%U", "/var/lib/restartkit"]).stdout.strip() == "rkuser"  # StateDirectory=
    unit = c.run(["systemctl", "cat", "restartkit-other.service"]).stdout
    assert "User=rkuser\nStateDirectory=restartkit\n" in unit and "RESTARTKIT_STATE_DIR" not in unit, unit
    st = c.run([RESTARTKIT, "status", "--policy", path, "--state-dir", "/var/lib/restartkit", "--json"],
               user="rkuser")
    assert json.loads(st.stdout)["serving"], st.stdout
    c.run(["systemctl", "stop", "restartkit-other.service", "restartkit-other.socket"])


def test_the_refresh_timer_fires_and_its_refresh_succeeds_with_criu_inside(booted):
    c = booted
    if not c.run(["test", "-x", "/opt/restartkit/criu/bin/criu"], check=False).returncode == 0:
        pytest.skip("no CRIU on this machine (scripts/install-criu) to bind into the container")
    path = policy(c, "snap", 8313, strategies='["criu", "cold"]', extra='\n[criu]\nrefresh = "*:*:0/15"\n')
    c.run([RESTARTKIT, "supervise", "--policy", path, "--install-unit"])
    out = c.run([RESTARTKIT, "snapshot", "refresh", "--policy", path, "--install-timer"]).stdout
    assert "restartkit-refresh-snap.timer" in out, out
    c.run(["systemctl", "daemon-reload"])
    c.run(["systemctl", "start", "restartkit-snap.socket", "restartkit-snap.service"], timeout=200)
    c.run(["systemctl", "start", "restartkit-refresh-snap.timer"])

    def refreshed():
        s = c.show("restartkit-refresh-snap.service", "Result", "ExecMainStatus", "NRestarts", "ActiveState",
                   "ExecMainExitTimestampMonotonic")
        return s if s["ExecMainExitTimestampMonotonic"] not in ("", "0") and s["ActiveState"] != "activating" else None
    s = c.wait(refreshed, timeout=150, every=1)
    assert s["Result"] == "success" and s["ExecMainStatus"] == "0", (s, journal(c, "restartkit-refresh-snap")[-3000:])
    snaps = json.loads(c.run([RESTARTKIT, "snapshot", "list", "--policy", path, "--json"]).stdout)
    assert snaps["snapshots"], snaps
    assert complete(c, 8313)["usage"]["completion_tokens"] >= 1  # the engine serves after its dump
    c.run(["systemctl", "stop", "restartkit-refresh-snap.timer", "restartkit-snap.service", "restartkit-snap.socket"])
