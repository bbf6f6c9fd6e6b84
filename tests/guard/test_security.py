"""Hostile neighbours, for real: a client on another "host" (a network
namespace joined by a veth pair, made by the test), another uid serving a
weight-cache socket, the `openai` client racing a starting engine, and the
modes of what a snapshot and a log hold."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import ROOT, free_port, run_cli

pytestmark = pytest.mark.slow
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root (network namespaces, another uid)")


def http_status(url: str, method: str = "GET", netns: str | None = None) -> int:
    code = ("import sys, urllib.request, urllib.error\n"
            f"req = urllib.request.Request({url!r}, data=b'' if {method!r} == 'POST' else None, method={method!r})\n"
            "try:\n    print(urllib.request.urlopen(req, timeout=10).status)\n"
            "except urllib.error.HTTPError as e:\n    print(e.code)\n")
    argv = [sys.executable, "-c", code]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return int(subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout)


@pytest.fixture
def two_hosts():
    """Namespaces `rk-srv-N` and `rk-cli-N` joined by a veth pair: 10.233.N.1 (server), .2 (client)."""
    if os.getuid() != 0:
        pytest.skip("needs root")
    n = os.getpid() % 200 + 20
    srv, cli = f"rk-srv-{n}", f"rk-cli-{n}"
    cmds = [f"ip netns add {srv}", f"ip netns add {cli}",
            f"ip link add rkv{n}a netns {srv} type veth peer name rkv{n}b netns {cli}",
            f"ip -n {srv} addr add 10.233.{n}.1/24 dev rkv{n}a", f"ip -n {cli} addr add 10.233.{n}.2/24 dev rkv{n}b",
            f"ip -n {srv} link set rkv{n}a up", f"ip -n {cli} link set rkv{n}b up", f"ip -n {srv} link set lo up"]
    try:
        for c in cmds:
            subprocess.run(c.split(), check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    yield srv, cli, f"10.233.{n}.1"
    subprocess.run(["ip", "netns", "del", srv], capture_output=True)
    subprocess.run(["ip", "netns", "del", cli], capture_output=True)


def test_admin_endpoints_answer_this_host_only(two_hosts, tiny_model, tmp_path):
    srv, cli, addr = two_hosts
    port = free_port()
    log = open(tmp_path / "engine.log", "wb")
    engine = subprocess.Popen(["ip", "netns", "exec", srv, sys.executable, "-m", "restartkit.reference.serving.server",
                               "--model", str(tiny_model), "--host", "0.0.0.0", "--port", str(port), "--threads", "1",
                               "--max-model-len", "256"], stdout=log, stderr=log, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http_status(f"http://127.0.0.1:{port}/health", netns=srv) == 200:
                    break
            except subprocess.CalledProcessError:
                pass
            assert time.monotonic() < deadline and engine.poll() is None, (tmp_path / "engine.log").read_text()
            time.sleep(0.5)
        remote = f"http://{addr}:{port}"
        assert http_status(remote + "/health", netns=cli) == 200  # the service itself is reachable
        assert http_status(remote + "/admin/stats", netns=cli) == 403
        assert http_status(remote + "/admin/drop_kv_cache", "POST", netns=cli) == 403
        assert http_status(remote + "/sleep?level=1", "POST", netns=cli) in (403, 404)
        assert http_status(f"http://127.0.0.1:{port}/admin/stats", netns=srv) == 200  # the host itself may
        assert http_status(remote + "/health", netns=cli) == 200  # the refused drop changed nothing
    finally:
        engine.kill()
        engine.wait()


def test_plan_says_when_the_service_binds_beyond_loopback(make_policy):
    policy = make_policy(service_extra='host = "0.0.0.0"\n')
    r = run_cli("plan", "--policy", policy)
    assert r.returncode == 0 and "binds 0.0.0.0" in r.stdout and "loopback only" in r.stdout, r.stdout


def test_plan_changes_nothing_on_disk(make_policy, tmp_path):
    sockdir = tmp_path / "never-made"
    policy = make_policy(extra=f'\n[ipc]\nsocket_dir = "{sockdir}"\n')
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert run_cli("plan", "--policy", policy, "--json").returncode == 0
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_an_open_socket_dir_is_refused_not_chmodded(make_policy, tmp_path):
    sockdir = tmp_path / "open"
    sockdir.mkdir()
    os.chmod(sockdir, 0o777)
    policy = make_policy(extra=f'\n[ipc]\nsocket_dir = "{sockdir}"\n')
    r = run_cli("weightcache", "status", "--policy", policy)
    assert r.returncode != 0 and "writable by others" in (r.stdout + r.stderr), r.stdout + r.stderr
    assert sockdir.stat().st_mode & 0o777 == 0o777  # reported, not silently changed


@root_only
def test_a_socket_served_by_another_uid_is_refused(make_policy, tmp_path):
    """Another uid puts its own "daemon" where the weight cache's socket would be (the dir made 0777
    by a careless operator): the client checks the peer's uid and refuses before it reads a reply."""
    import shutil
    import tempfile
    from pathlib import Path
    from restartkit.weightcache import protocol
    sockdir = Path(tempfile.mkdtemp(prefix="rk-rogue-"))  # under /tmp: reachable by another user
    os.chmod(sockdir, 0o777)
    sock = sockdir / "rogue.sock"
    rogue = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "import socket, json, struct, os\n"
         f"s = socket.socket(socket.AF_UNIX); s.bind({str(sock)!r}); os.chmod({str(sock)!r}, 0o777); s.listen(4)\n"
         "while True:\n"
         "    c, _ = s.accept(); body = json.dumps({'ok': True, 'state': 'ready'}).encode()\n"
         "    c.sendall(struct.pack('<I', len(body)) + body); c.close()\n"], cwd=ROOT)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(protocol.ProtocolError, match="writable by others"):
            protocol.request(sock, {"op": "stats"}, timeout=5)
        os.chmod(sockdir, 0o755)  # even in a closed directory: the socket is someone else's
        with pytest.raises(protocol.ProtocolError, match="uid 65534"):
            protocol.request(sock, {"op": "stats"}, timeout=5)
    finally:
        rogue.kill()
        rogue.wait()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_models_list_waits_for_readiness_as_clients_expect(make_policy, service_cleanup):
    """The openai client's habit: poll models.list() until it works, then complete at once."""
    import openai
    policy = make_policy()
    service_cleanup(policy)
    port = int(policy.read_text().split("port = ")[1].split()[0])
    starter = threading.Thread(target=run_cli, args=("start", "--policy", policy), daemon=True)
    starter.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=10)
    deadline = time.monotonic() + 90
    while True:
        try:
            model = client.models.list().data[0].id
            break
        except (openai.APIConnectionError, openai.APIStatusError) as e:
            assert getattr(e, "status_code", 503) == 503, e
            assert time.monotonic() < deadline
            time.sleep(0.02)
    out = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=4, temperature=0)
    assert out.choices[0].text is not None and out.usage.completion_tokens >= 1
    starter.join(90)


def test_logs_and_images_are_private(make_policy, service_cleanup):
    policy = make_policy(service_extra='env = {VLLM_API_KEY = "sk-secret-123"}\n')
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    state = policy.parent / "state" / "svc"
    assert (state / "engine.log").stat().st_mode & 0o077 == 0
    from restartkit.facts import criu_facts
    if os.getuid() != 0 or not criu_facts().check_ok:
        return
    r = run_cli("snapshot", "create", "--policy", policy, "--json")
    assert r.returncode == 0, r.stderr
    assert "VLLM_API_KEY" in r.stderr and "holds it" in r.stderr  # warned: the image holds the key
    images = state / "snapshots" / json.loads(r.stdout)["id"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in images.iterdir() if p.is_file()}
    assert all(m & 0o077 == 0 for m in modes.values()), {k: oct(m) for k, m in modes.items() if m & 0o077}
    policy.write_text(policy.read_text().replace("[criu]\n", "") + "\n[criu]\nrefuse_secrets = true\n")
    r = run_cli("snapshot", "create", "--policy", policy)
    assert r.returncode == 2 and "VLLM_API_KEY" in r.stderr and "refuse_secrets" in r.stderr, r.stderr


def test_metrics_files_parse_and_escape_label_values(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    from restartkit.record import Record, _family, update_metrics, write_textfile
    rec = Record(service="svc", policy="p.toml", requested="cold", reason="restart", plan={})
    rec.attempts = [{"strategy": "cold", "ok": True, "proof": {}}]
    rec.final_state, rec.served_by, rec.time_to_ready_s = "serving", "cold", 1.25
    prom = update_metrics(tmp_path, rec)
    families = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    assert families["restartkit_restart"].type == "counter"
    assert families["restartkit_last_time_to_ready_seconds"].type == "gauge"
    sample = families["restartkit_restart"].samples[0]
    assert sample.name == "restartkit_restart_total" and sample.value == 1
    assert sample.labels == {"service": "svc", "strategy": "cold", "outcome": "ok"}
    hostile = 'a"b\\c\nd'
    write_textfile(tmp_path / "x.prom", [_family("gauge", "restartkit_x", "x", ["what"], {(hostile,): 1}, "svc")])
    text = (tmp_path / "x.prom").read_text()
    assert len(text.strip().splitlines()) == 3  # HELP, TYPE, one sample: the newline did not break a line
    parsed = next(iter(text_string_to_metric_families(text))).samples[0]
    assert parsed.labels["what"] == hostile
