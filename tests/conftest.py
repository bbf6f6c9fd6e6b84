import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.helpers import free_port, run_cli


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from restartkit.reference.model.checkpoint import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture
def make_policy(tmp_path, tiny_model):
    """Write a policy for the tiny model on a free port; returns its path."""
    def make(extra: str = "", model: str | None = None, name: str = "svc", service_extra: str = "", port: int | None = None,
             front: str = "") -> Path:
        """`front`: more keys of [front] (its engine_port is a free one: supervise's engines serve there)."""
        port = port or free_port()
        text = textwrap.dedent(f"""\
            [service]
            name = "{name}"
            engine = "reference"
            model = "{model or tiny_model}"
            port = {port}
            max_model_len = 256
            engine_args = ["--threads", "1"]
            state_dir = "{tmp_path / 'state'}"
            """) + service_extra + f"\n[front]\nengine_port = {free_port()}\n{front}" + textwrap.dedent("""
            [restart]
            start_timeout_s = 60
            stop_timeout_s = 10
            canary_max_tokens = 8
            """) + extra
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        return path
    return make


@pytest.fixture
def service_cleanup():
    """Stop every engine a test started, whatever happens."""
    policies = []
    yield policies.append
    for p in policies:
        run_cli("stop", "--policy", p)


# ---- fixtures several files share (their helpers: tests/helpers.py) ---------------------------
@pytest.fixture
def sockdir(tmp_path):
    """A private socket dir for the weight cache."""
    d = tmp_path / "sockets"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def preloads():
    """Weight-cache launchers started by a test; all stopped at the end."""
    import signal
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def served(make_policy, service_cleanup):
    """Start a reference engine under a policy with a [criu] section; returns its path."""
    def make(extra='pid_wait_s = 5.0\n'):
        policy = make_policy(extra='\n[criu]\n' + extra)
        service_cleanup(policy)
        assert run_cli("start", "--policy", policy).returncode == 0
        return policy
    return make


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """vLLM's CPU attention needs head_dim >= 32: the `small` preset (head_dim 64)."""
    from restartkit.reference.model.checkpoint import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("models") / "small", "small")


@pytest.fixture
def supervised(make_policy, service_cleanup, tmp_path):
    """`restartkit supervise` on a policy (fast probes), its notify socket the test's."""
    from tests.helpers import Supervised, supervise_fast
    made = []

    def make(policy=None, burst=5, env=None, wait_ready=True, min_uptime_s=5.0):
        policy = policy or make_policy()
        policy.write_text(policy.read_text() + supervise_fast(burst, min_uptime_s))
        service_cleanup(policy)
        s = Supervised(policy, tmp_path, env)
        made.append(s)
        if wait_ready:
            s.wait_note("READY=1")
        return s
    yield make
    for s in made:
        s.close()
