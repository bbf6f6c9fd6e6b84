"""Overlapped ipc restart under client load: the new engine prepares while
the old one serves, takes the port beside it, and only then is the old one
stopped.  No wrong answers, downtime measured; a new engine that fails to
prepare leaves the old one serving."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers import ROOT, free_port, run_cli

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

    def __init__(self, port, timeout_s=2.0):
        super().__init__(daemon=True)
        self.timeout_s = timeout_s
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.results = []  # (time, kind, tokens, engine)
        self.stop = threading.Event()

    def run(self):
        body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}).encode()
        while not self.stop.is_set():
            t = time.monotonic()
            req = urllib.request.Request(self.url, data=body, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    out = json.loads(r.read())
                self.results.append((t, "ok", out["choices"][0]["token_ids"], out["system_fingerprint"]))
            except urllib.error.HTTPError as e:
                self.results.append((t, f"http {e.code}", None, None))
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                kind = "timeout" if "timed out" in str(reason) else "connection"
                self.results.append((t, kind, None, None))
            time.sleep(0.01)



def test_an_old_engine_frozen_mid_overlap_is_killed_once_the_new_one_serves(overlap_service):
    """The old engine SIGSTOPped while the new one prepares: once the stop waited the old engine's whole stop
    timeout (the restart took 19.2 s, a client waited 15.4 s).  A frozen engine drains nothing: it is killed
    as soon as it is found frozen, what it held fails fast; the restart ends within 12 s and no client waits
    6 s."""
    policy, _ = overlap_service
    old_pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    intent = policy.parent / "state" / "svc" / "intent.json"
    hammer = Hammer(port_of(policy), timeout_s=6.0)
    hammer.start()
    time.sleep(0.5)
    p = subprocess.Popen([sys.executable, "-m", "restartkit.cli", "restart", "--policy", str(policy), "--strategy",
                          "ipc", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        end = time.monotonic() + 60
        while not (intent.exists() and json.loads(intent.read_text() or "{}").get("pids")):  # the new one spawned
            assert time.monotonic() < end and p.poll() is None, "the restart never started a new engine"
            time.sleep(0.005)
        os.kill(old_pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - frozen_at
    finally:
        hammer.stop.set()
        hammer.join(10)
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out + err
    rec = json.loads(out)
    assert rec["served_by"] == "ipc" and rec["proof"]["canary_identical"] is True, rec
    assert took < 12, (took, err)
    assert not os.path.exists(f"/proc/{old_pid}") or open(f"/proc/{old_pid}/stat").read().split()[2] == "Z"
    assert not [x for x in hammer.results if x[1] == "timeout"], "a client waited 6 s"
    assert len({tuple(x[2]) for x in hammer.results if x[1] == "ok"}) == 1, "a wrong answer"

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
    assert f'restartkit_last_downtime_seconds{{service="svc",strategy="ipc"}} {rec["downtime"]["downtime_s"]}' in prom
    assert f'restartkit_downtime_seconds{{service="svc",strategy="ipc"}} {rec["downtime"]["downtime_s"]}' in prom  # old
    assert rec["downtime"]["downtime_s"] is not None and rec["downtime"]["downtime_s"] < a["engine_phases"]["ready_since_spawn"]
    status = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert status["serving"] and status["pid"] == a["proof"]["new_pid"] != old_pid


def engine_on(port, model, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "restartkit.reference.serving.server", "--model", str(model), "--port",
                             str(port), "--max-model-len", "256", "--threads", "1", "--reuse-port", *extra],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def answered_by(port) -> int:
    """The PID of the engine that answers a new connection."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/stats", timeout=10) as r:
        return json.load(r)["pid"]


def wait_answering(port, proc, timeout=120):
    """Until it answers 30 new connections in a row (ready, it takes over within its 0.2 s signal poll).  Before
    it takes over, the hash hands it about half: 30 in a row by chance is 2**-30 a try (10 were 2**-10, and a wait
    of a few hundred tries then passed by chance about once in a few CI runs)."""
    end = time.monotonic() + timeout
    while True:
        try:
            if all(answered_by(port) == proc.pid for _ in range(30)):
                return
        except OSError:
            pass
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < end, "the engine did not answer on the port"
        time.sleep(0.05)


def test_an_engine_taking_the_port_beside_another_takes_every_new_connection(tiny_model):
    """SO_REUSEPORT alone spreads new connections over both engines by hash, so the old one keeps
    being handed about half of them until it closes (and closing resets those queued on it).  The
    engine that joins takes them all; the old one only finishes what it had.  Three generations:
    the third joins beside the second once the first is gone."""
    port = free_port()
    procs = [engine_on(port, tiny_model)]
    try:
        wait_answering(port, procs[0])
        for generation in (1, 2):
            procs.append(engine_on(port, tiny_model))
            wait_answering(port, procs[-1])
            assert {answered_by(port) for _ in range(30)} == {procs[-1].pid}  # by hash: 2**-29 to pass
            old = procs[-2]
            old.terminate()
            assert old.wait(60) == 0
            assert {answered_by(port) for _ in range(10)} == {procs[-1].pid}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_stopping_engine_answers_the_connections_queued_on_its_listener(tiny_model):
    """Closing a listener resets the connections in its queue.  Beside a successor (SO_REUSEPORT) the
    kernel keeps queuing some of the new connections on the old engine's listener until it closes, so a
    client saw a reset in an overlapped restart on the H200 (1 request of 2 restarts).  Here the engine
    is stopped (SIGSTOP) while 20 clients connect and send a completion, then asked to stop: every one
    is answered (all 20 were reset before; past the 6th they were not even accepted into the queue)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "restartkit.reference.serving.server", "--model", str(tiny_model),
                             "--port", str(port), "--max-model-len", "256", "--threads", "1", "--reuse-port"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < end, "the engine did not get ready"
                time.sleep(0.1)
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}).encode()
        request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        os.kill(proc.pid, signal.SIGSTOP)  # nothing accepts: the connections wait in the listener's queue
        clients = []
        for _ in range(20):
            c = socket.create_connection(("127.0.0.1", port), timeout=30)
            c.sendall(request)
            clients.append(c)
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
        answers = []
        for c in clients:
            data = b""
            try:
                while chunk := c.recv(65536):
                    data += chunk
            except OSError as e:
                data = repr(e).encode()
            c.close()
            answers.append(data.split(b"\r\n", 1)[0])
        assert proc.wait(60) == 0, proc.stderr.read().decode()[-2000:]
        assert answers == [b"HTTP/1.1 200 OK"] * 20, answers
    finally:
        if proc.poll() is None:
            proc.kill()  # stopped or not
        proc.wait()


def test_a_stopping_engine_says_so_and_sends_keep_alive_clients_to_a_new_connection():
    """While it drains, /health says "stopping" and every answer says Connection: close, so a client's
    next request opens a new connection, which reaches the engine after this one."""
    import http.client

    from restartkit.reference.serving.api import EngineServer, State
    state = State("m")
    server = EngineServer(("127.0.0.1", 0), state)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())["status"], r.getheader("Connection")) == (503, "loading", None)
        state.stopping = True
        conn.request("GET", "/health")  # the same connection, kept alive
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())["status"], r.getheader("Connection")) == (503, "stopping", "close")
        conn.close()
    finally:
        server.stop_listening()


def test_the_downtime_is_read_against_the_probes_own_cycle():
    """The longest gap between two answered requests includes one answer's latency plus the interval;
    the median gap says what that cycle is without a restart."""
    from restartkit.downtime import DowntimeProbe
    probe = DowntimeProbe(service=None)
    probe.started_at = 0.0
    probe.events = [(0.06 * i, True, "") for i in range(1, 6)] + [(0.35, False, "503"), (0.5, True, ""),
                                                                   (0.56, True, "")]
    summary = probe.summary()  # the cycle: answers that follow each other, not the gap around the 503
    assert summary["downtime_s"] == 0.2 and summary["gap_from_s"] == 0.3 and summary["median_gap_s"] == 0.06
    assert summary["failed"] == {"503": 1} and summary["answered"] == 7
    # a cold restart: few answers, refused requests between them; the cycle is still that of two answers in a row
    probe.events = [(0.1, True, ""), (0.2, True, ""), (0.7, False, "connection"), (1.2, True, ""),
                    (1.7, False, "503"), (2.2, True, ""), (2.7, False, "503"), (3.2, True, ""), (3.3, True, "")]
    summary = probe.summary()
    assert summary["median_gap_s"] == 0.1 and summary["downtime_s"] == 1.0 and summary["answered"] == 6
