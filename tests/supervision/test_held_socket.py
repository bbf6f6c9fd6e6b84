"""The service's listening socket outlives every engine (restartkit.process.listener): under supervise a
crash refuses no connection.  Real engines, a real weight cache and standby, real SIGKILLs, clients that
open a new connection per request and never retry; the official openai client; systemd's socket
activation through systemd-socket-activate."""
import json
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

import tests.helpers as helpers

from restartkit.clients import ClientLoad, summarize
from restartkit.process.procfs import port_has_listener
from tests.helpers import RESTARTKIT, ROOT, ipc_policy, run_cli, start_preload, Supervised, supervise_fast

pytestmark = pytest.mark.slow

STANDBY = '\n[standby]\nenabled = true\nkv_ahead = "never"\n'


def port_of(policy) -> int:
    return int(policy.read_text().split("port = ")[1].split()[0])


def status(policy) -> dict:
    return json.loads(run_cli("status", "--policy", policy, "--json").stdout)


def wait_for(what, timeout=90):
    return helpers.wait_for(what, timeout, every=0.1)


def armed_other_than(policy, pids) -> int:
    sb = wait_for(lambda: (st := status(policy)["standby"]) and st["state"] == "prepared" and st["pid"] not in pids
                  and st)
    return sb["pid"]


KILLS = 6  # more than [supervise] start_limit_burst's default (5)
MIN_UPTIME_S = 2.0  # [supervise] min_uptime_s here: each kill waits past it (a crash while serving), not past 5 s


def standby_policy(make_policy, sockdir):
    policy = ipc_policy(make_policy, sockdir)
    policy.write_text(policy.read_text() + STANDBY)
    return policy


def test_a_crash_under_supervise_refuses_no_connection(supervised, make_policy, sockdir, preloads):
    """4 clients, a new connection per request, no retries; the serving engine SIGKILLed 6 times under the
    default start limit (start_limit_burst 5 in 600 s), each time after it served past min_uptime_s, each time
    served by the standby: supervise keeps running (a crash while serving is no failed start), no refused
    connection, no 5xx, no more lost than were in flight, no wait over 3 s, kill -> first answer median <= 1 s;
    the answers the same before and after."""
    policy = standby_policy(make_policy, sockdir)
    start_preload(policy, preloads)
    s = supervised(policy, min_uptime_s=MIN_UPTIME_S)
    load = ClientLoad("127.0.0.1", port_of(policy), "tiny", clients=4, max_tokens=4).start()
    kills, seen = [], set()
    try:
        for _ in range(KILLS):
            engine = status(policy)["pid"]
            seen.add(engine)
            armed_other_than(policy, seen)
            time.sleep(MIN_UPTIME_S + 0.5)  # it has served past [supervise] min_uptime_s: a crash, not a failed start
            kills.append(time.monotonic())
            os.kill(engine, signal.SIGKILL)
            wait_for(lambda: (st := status(policy))["serving"] and st["pid"] not in seen)
        time.sleep(2.0)
    finally:
        load.stop()
    assert s.proc.poll() is None, "supervise gave up on crashes of an engine that had served"
    got = summarize(load.snapshot(), kills, clients=4)
    recs = s.records()
    assert [r["served_by"] for r in recs[-KILLS:]] == ["standby"] * KILLS, [(r["served_by"], r["attempts"]) for r in recs]
    assert all(r["proof"]["canary_identical"] for r in recs[-KILLS:])
    assert got["refused"] == 0 and got["http_5xx"] == 0 and got["timeouts"] == 0, got
    assert got["lost"] == 0, got  # those in flight at a kill continued by the front (on by default)
    slow = [(round(r.started - kills[0], 2), round(r.waited_s, 2), r.connected and round(r.connected - r.started, 2),
             r.outcome, r.detail) for r in load.snapshot() if r.waited_s > 3.0]
    assert got["longest_wait_s"] <= 3.0, (got, slow, [round(k - kills[0], 2) for k in kills],
                                          [(r["time_to_ready_s"], r["trigger"]) for r in recs[-KILLS:]])
    assert got["kill_to_answer_median_s"] <= 1.0, got
    assert len({tuple(a) for a in load.answers}) == 1 and len(load.answers) > 50, got
    # the engine's own count of the requests it held when it died (a connection not yet read is not counted):
    # the 4 clients' and, at most one, supervise's own health or completion probe; the front continued them
    counted = [r["trigger"]["in_flight"] for r in recs[-KILLS:]]
    assert all(isinstance(n, int) and 0 <= n <= 4 + 1 for n in counted) and sum(counted) > 0, (counted, got)
    assert all(r["trigger"]["behind_front"] and r["trigger"]["lost_in_flight"] is None for r in recs[-KILLS:])


def test_the_openai_client_sees_no_error_across_kills(supervised, make_policy, sockdir, preloads):
    """The official client, its default retries: three SIGKILLs under supervise, no exception, the same answers."""
    openai = pytest.importorskip("openai")
    policy = standby_policy(make_policy, sockdir)
    start_preload(policy, preloads)
    supervised(policy, min_uptime_s=MIN_UPTIME_S)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(policy)}/v1", api_key="none")

    def ask() -> str:
        return client.completions.create(model="tiny", prompt="The answer is", max_tokens=6, temperature=0).choices[0].text
    before, seen = ask(), set()
    for _ in range(3):
        engine = status(policy)["pid"]
        seen.add(engine)
        armed_other_than(policy, seen)
        time.sleep(MIN_UPTIME_S + 0.5)
        os.kill(engine, signal.SIGKILL)
        answers = [ask() for _ in range(5)]  # the first right after the kill: it waits in the socket's queue
        assert answers == [before] * 5
        wait_for(lambda: (st := status(policy))["serving"] and st["pid"] not in seen)


def test_a_cold_restart_under_supervise_keeps_clients_waiting_instead_of_refusing(supervised, make_policy):
    """No standby, no weight cache: a SIGHUP's cold restart and a SIGKILL's cold recovery take seconds, and the
    clients wait for them in the held socket's queue; `restart` run beside supervise serves on it too; plan says
    which of the two applies.  Streams in flight across the three (two planned restarts, one crash) are continued
    by the front: none fails, each answer token-identical to the undisturbed one."""
    from tests.streams import ClientsThroughKills, mixed_requests
    policy = make_policy()
    s = supervised(policy, min_uptime_s=MIN_UPTIME_S)
    plan = run_cli("plan", "--policy", policy)
    assert "is held by `restartkit supervise`" in plan.stdout, plan.stdout
    st = status(policy)
    assert st["supervisor"]["listener"]["front"]["port"] == port_of(policy), st["supervisor"]  # the front's
    streams = ClientsThroughKills(port_of(policy), mixed_requests(4, low=60, high=120))
    want = streams.undisturbed()
    load = ClientLoad("127.0.0.1", port_of(policy), "tiny", clients=2, max_tokens=2).start()
    streams.start()
    try:
        time.sleep(1.0)
        os.kill(s.proc.pid, signal.SIGHUP)
        s.wait_record(1)
        r = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")
        assert r.returncode == 0, r.stderr
        engine = status(policy)["pid"]
        time.sleep(MIN_UPTIME_S + 0.5)
        os.kill(engine, signal.SIGKILL)
        wait_for(lambda: (x := status(policy))["serving"] and x["pid"] != engine)
        time.sleep(1.0)
    finally:
        load.stop()
        streams.finish()
    got = summarize(load.snapshot(), [], clients=2)
    assert got["refused"] == 0 and got["http_5xx"] == 0, got
    assert got["counts"].get("ok", 0) > 10 and got["lost"] == 0, got
    assert [r["served_by"] for r in s.records()] == ["cold", "cold", "cold"]
    assert streams.failures == [] and len(streams.answers) >= 4, streams.failures[:3]
    assert all(got == want[i] for i, got in streams.answers)


def test_without_supervise_plan_says_connections_are_refused(make_policy, service_cleanup):
    policy = make_policy()
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    plan = run_cli("plan", "--policy", policy)
    assert "connections are refused" in plan.stdout, plan.stdout


def test_a_neighbour_on_the_port_makes_supervise_give_up_naming_it(make_policy, service_cleanup, tmp_path):
    policy = make_policy()
    service_cleanup(policy)
    with socket.socket() as neighbour:
        neighbour.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        neighbour.bind(("127.0.0.1", port_of(policy)))
        neighbour.listen(8)
        policy.write_text(policy.read_text() + supervise_fast(1))
        r = subprocess.run([*RESTARTKIT, "supervise", "--policy", str(policy)], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
    assert r.returncode == 2 and f"cannot bind 127.0.0.1:{port_of(policy)}, where the front answers" in r.stderr, r.stderr
    assert f"PID {os.getpid()} listens there" in r.stderr, r.stderr


@pytest.mark.skipif(not shutil.which("systemd-socket-activate"), reason="systemd-socket-activate is not installed")
def test_socket_activation_serves_on_the_passed_socket_across_a_sigkill(make_policy, service_cleanup, tmp_path):
    """systemd-socket-activate -l 127.0.0.1:PORT restartkit supervise: the socket it passed is the one every
    engine serves on (its inode in supervisor.json), and a SIGKILL of the engine refuses no connection."""
    policy = make_policy()
    policy.write_text(policy.read_text() + supervise_fast(5, MIN_UPTIME_S))
    service_cleanup(policy)
    port = port_of(policy)
    act = subprocess.Popen(["systemd-socket-activate", "-l", f"127.0.0.1:{port}", *RESTARTKIT, "supervise",
                            "--policy", str(policy)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        # systemd-socket-activate binds the port first; it starts supervise on the first connection, which
        # waits in the queue
        wait_for(lambda: port_has_listener(port), 30)
        load = ClientLoad("127.0.0.1", port, "tiny", clients=2, max_tokens=2, timeout_s=60).start()
        try:
            st = wait_for(lambda: (x := status(policy))["serving"] and (x.get("supervisor") or {}).get("listener") and x, 120)
            assert st["supervisor"]["listener"]["front"]["source"] == "systemd", st["supervisor"]  # clients' socket
            time.sleep(MIN_UPTIME_S + 0.5)
            os.kill(st["pid"], signal.SIGKILL)
            wait_for(lambda: (x := status(policy))["serving"] and x["pid"] != st["pid"])
            time.sleep(1.0)
        finally:
            load.stop()
        got = summarize(load.snapshot(), [], clients=2)
        assert got["refused"] == 0 and got["http_5xx"] == 0 and got["counts"].get("ok", 0) > 5, got
    finally:
        os.killpg(act.pid, signal.SIGTERM)
        out = act.communicate(timeout=60)[0]
    assert f"answering on port {port} (systemd)" in out, out


def test_a_probe_queued_on_the_held_socket_does_not_delay_noticing_a_death(make_policy, service_cleanup, tmp_path):
    """supervise's /health probe of a frozen engine waits in the held socket's queue (nothing accepts there
    until supervise acts); when the engine is then killed, supervise notices at once, not at the probe's
    timeout (10 s here): a probe never stands between a death and its noticing."""
    from tests.helpers import Supervised, supervise_fast
    policy = make_policy()
    policy.write_text(policy.read_text() + supervise_fast(5, MIN_UPTIME_S).replace("health_timeout_s = 1.0",
                                                                                 "health_timeout_s = 10.0"))
    service_cleanup(policy)
    s = Supervised(policy, tmp_path)
    try:
        s.wait_note("READY=1")
        engine = status(policy)["pid"]
        time.sleep(MIN_UPTIME_S + 0.5)  # past min_uptime_s: a crash while serving
        os.kill(engine, signal.SIGSTOP)
        time.sleep(1.5)  # a health probe (every 0.5 s) is now queued on the held socket
        killed_at = time.time()
        os.kill(engine, signal.SIGKILL)
        rec = s.wait_record(1)
    finally:
        s.close()
    assert rec["reason"] == "crash" and "exited" in rec["trigger"]["what"], rec["trigger"]
    assert rec["trigger"]["noticed_at"] - killed_at < 1.0, (rec["trigger"]["noticed_at"] - killed_at, rec["trigger"])
