"""Trust nobody local: an address is not a credential.  Another local user (`nobody`), or any local process without
the service's admin token, can use no admin route of an engine restartkit started, cannot hand an engine a socket
through the broker's name, and a forged engine.json gets nothing signalled.  restartkit's own calls still work."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from restartkit.guard import admin
from restartkit.process import listener
from tests.helpers import ask_as, run_cli

root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root (another uid)")
ATTACK = """\
import json, sys, urllib.request, urllib.error
port, token = int(sys.argv[1]), sys.argv[2]
out = {}
for method, path in [("GET", "/admin/stats"), ("POST", "/admin/drop_kv_cache"), ("POST", "/admin/release_weights"),
                     ("POST", "/admin/detach_listener"), ("POST", "/sleep?level=1"), ("POST", "/wake_up")]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b'{"broker": "x"}' if method == "POST" else None,
                                 method=method, headers={"X-Restartkit-Admin": token} if token else {})
    try:
        out[path] = urllib.request.urlopen(req, timeout=20).status
    except urllib.error.HTTPError as e:
        out[path] = e.code
print(json.dumps(out))
"""


def attack(port: int, token: str = "", user: str | None = None) -> dict:
    """The admin routes as a local client sees them: the system Python (stdlib only), as `user`."""
    argv = ["/usr/bin/python3", "-c", ATTACK, str(port), token]
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout)


def port_of(policy) -> int:
    return int(next(ln.split("=")[1] for ln in policy.read_text().splitlines() if ln.startswith("port")))


@pytest.mark.slow
def test_no_admin_route_answers_a_local_client_without_the_token(make_policy, service_cleanup):
    policy = make_policy(extra="\n[sleep]\nenabled = true\nlevel = 1\n")
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    port = port_of(policy)
    users = [None, "nobody"] if os.getuid() == 0 else [None]
    for user in users:
        got = attack(port, user=user)
        assert set(got.values()) == {403}, (user, got)
    wrong = attack(port, token="0" * 64)
    assert set(wrong.values()) == {403}, wrong
    status = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert status["serving"], status  # nothing the attempts asked for happened
    # restartkit's own calls carry the token: a sleep cycle through the CLI works
    assert run_cli("sleep", "--policy", policy, "--level", "1").returncode == 0
    assert run_cli("wake", "--policy", policy).returncode == 0
    token = (policy.parent / "state" / "svc" / admin.TOKEN_FILE)
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    engine = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    assert admin.token(policy.parent / "state" / "svc").encode() not in open(f"/proc/{engine}/cmdline", "rb").read()


@root_only
def test_a_broker_of_another_user_hands_nothing(tmp_path):
    """Whoever binds an address the engine would take its socket back from: another user's process is refused
    by SO_PEERCRED before anything is received."""
    name = f"\0restartkit-test-squat-{os.getpid()}"
    squat = subprocess.Popen(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", f"""
import socket, sys
s = socket.socket(socket.AF_UNIX); s.bind({name!r}); s.listen(4)
bait = socket.socket(); bait.bind(("127.0.0.1", 0)); bait.listen(1)
print("ready", flush=True)
while True:
    c, _ = s.accept(); socket.send_fds(c, [b"L"], [bait.fileno()]); c.close()
"""], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert squat.stdout.readline().strip() == "ready"
        assert listener.fetch_from(name, timeout_s=2) is None
    finally:  # runuser's child too (runuser passes no SIGKILL on): the whole group
        os.killpg(squat.pid, signal.SIGKILL)
        squat.wait()


@pytest.mark.slow
def test_supervise_refuses_to_start_when_its_broker_name_is_taken(make_policy):
    policy = make_policy()
    state = policy.parent / "state" / "svc"
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    squat = socket.socket(socket.AF_UNIX)
    squat.bind(listener.engine_broker(state))
    try:
        r = subprocess.run([sys.executable, "-m", "restartkit.cli", "supervise", "--policy", str(policy)],
                           capture_output=True, text=True, timeout=120)
    finally:
        squat.close()
    assert r.returncode == 2 and "broker address" in r.stderr and "is taken" in r.stderr, r.stderr
    assert not json.loads(run_cli("status", "--policy", policy, "--json").stdout)["serving"]


def test_the_broker_name_is_not_derived_from_anything_public(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(mode=0o700)
    b.mkdir(mode=0o700)
    name = listener.engine_broker(a)
    assert name == listener.engine_broker(a) != listener.engine_broker(b)
    # the token alone names it (0600, in the 0700 state dir): a new token, a new name; the path and the uid do not
    from restartkit.guard import admin
    assert name == admin.broker_name((a / admin.TOKEN_FILE).read_text().strip())
    (a / admin.TOKEN_FILE).unlink()
    assert listener.engine_broker(a) != name and str(a) not in name


def test_stop_signals_no_process_a_forged_engine_json_names(make_policy):
    """engine.json naming a process of this user that restartkit did not start (right PID, right start time):
    stop leaves it alone."""
    from restartkit.process.procfs import create_time, proc_start_ticks
    policy = make_policy()
    victim = subprocess.Popen(["sleep", "60"])
    try:
        state = policy.parent / "state" / "svc"
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
        (state / "engine.json").write_text(json.dumps({"pid": victim.pid, "create_time": create_time(victim.pid),
                                                       "start_ticks": proc_start_ticks(victim.pid), "ready": True}))
        r = run_cli("stop", "--policy", policy)
        time.sleep(0.5)
        assert victim.poll() is None, r.stdout + r.stderr
        assert "not signalled" in r.stdout + r.stderr, r.stdout + r.stderr
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


def test_an_inherited_vllm_dev_mode_is_not_passed_on(make_policy):
    """VLLM_SERVER_DEV_MODE in restartkit's environment serves vLLM's /collective_rpc to anyone: a vLLM restartkit
    starts without sleep mode does not inherit it; with sleep mode it is set, and the launcher keys its routes."""
    from restartkit.engines.vllm import VLLMAdapter
    from restartkit.engines.vllm_serve import DEV_ROUTES, admin_allowed
    from restartkit.policy import load_policy
    policy = make_policy()
    policy.write_text(policy.read_text().replace('engine = "reference"', 'engine = "vllm"'))
    spec = VLLMAdapter().launch(load_policy(policy))
    assert "VLLM_SERVER_DEV_MODE" in spec.unset and "VLLM_SERVER_DEV_MODE" not in spec.env
    policy.write_text(policy.read_text() + "\n[sleep]\nenabled = true\n")
    spec = VLLMAdapter().launch(load_policy(policy))
    assert spec.env["VLLM_SERVER_DEV_MODE"] == "1" and not spec.unset
    assert {"/collective_rpc", "/sleep", "/wake_up", "/server_info"} <= set(DEV_ROUTES)
    os.environ[admin.ADMIN_TOKEN_ENV] = "a" * 64
    try:
        assert not admin_allowed({}, "127.0.0.1")  # loopback is not a credential
        assert admin_allowed({admin.ADMIN_HEADER: "a" * 64}, "127.0.0.1")
    finally:
        del os.environ[admin.ADMIN_TOKEN_ENV]
    assert admin_allowed({}, "127.0.0.1") and not admin_allowed({}, "10.0.0.2")  # a launcher run by hand


@root_only
@pytest.mark.slow
def test_behind_the_front_an_engine_answers_its_own_user_only(supervised, make_policy):
    """Under supervise the engines serve on a loopback port behind the front: another local user asking there
    directly gets a 403 that says where to ask; through the front the same user is answered, and so are
    restartkit's own calls (its user, or root) on the engine's port."""
    policy = make_policy()
    supervised(policy)
    front = port_of(policy)
    engine = int(policy.read_text().split("engine_port = ")[1].split()[0])
    mine = ask_as(engine)
    assert mine[0] == 200, mine
    theirs = ask_as(engine, "nobody")
    assert theirs[0] == 403 and "serves restartkit's front only" in theirs[1] and "uid 65534" in theirs[1], theirs
    assert ask_as(front, "nobody") == mine  # the same greedy answer, through the front
    stats = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{engine}/admin/stats", headers=admin.headers(policy.parent / "state" / "svc")),
        timeout=30).read())
    assert stats["owner_only"] == {"refused": 1}, stats
