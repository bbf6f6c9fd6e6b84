"""The weight cache as a library call: policy + flags -> a layout (build), the cache started or stopped for a
service, and a wait until it is ready.  `restartkit preload` (restartkit/commands/preload.py), the demo and
rollout use it."""
from __future__ import annotations

import os
import subprocess
import sys

from restartkit.errors import EXIT_NOT_SERVING, EXIT_SERVING, UsageError

FLAG_TO_LAYOUT = {"model": "model", "tensor_parallel_size": "tp_size", "data_parallel_size": "dp_size",
                  "data_parallel_start_rank": "dp_start_rank", "enable_expert_parallel": "expert_parallel",
                  "device": "device", "dtype": "dtype", "quantization": "quantization", "nnodes": "nnodes",
                  "node_rank": "node_rank", "master_addr": "master_addr",
                  "weight_cache_master_port": "weight_cache_master_port", "draft_model": "draft_model",
                  "socket_dir": "socket_dir"}


NO_FLAGS = {**{k: None for k in FLAG_TO_LAYOUT}, "startup_timeout": None, "health_host": None, "health_port": None}


def start_weight_cache(policy, say) -> int:
    """Start the policy's weight cache in the background and return once every local rank
    is ready (`restartkit preload --detach`); the exit code of that command."""
    return detached(policy.path, NO_FLAGS, say, policy.state_root)


def stop_weight_cache(policy) -> list[dict]:
    """Stop every daemon of the policy's weight cache, attached engines or not."""
    from restartkit.weightcache.client import send_all
    return send_all(policy, "stop", force=True)


def build(policy_path: str | None, flags: dict, state_root: str = ""):
    from restartkit.weightcache.client import layout_from_policy
    from restartkit.weightcache.launcher import Layout
    policy = None
    if policy_path:
        from restartkit.policy import load_policy
        policy = load_policy(policy_path, state_root)
        layout = layout_from_policy(policy)
        i = policy.ipc
        timeout, host, port = i["startup_timeout_s"], i["health_host"], i["health_port"]
    else:
        if not flags.get("model"):
            raise UsageError("give --policy or --model")
        layout, timeout, host, port = Layout(model=flags["model"]), 900.0, "127.0.0.1", 0
    for flag, attr in FLAG_TO_LAYOUT.items():
        if flags.get(flag) is not None:
            setattr(layout, attr, flags[flag])
    if not policy_path and flags.get("dtype") is None and layout.device == "cuda":
        from restartkit.weightcache.client import _checkpoint_dtype
        layout.dtype = _checkpoint_dtype(layout.model)
    timeout = flags["startup_timeout"] or timeout
    host = flags["health_host"] or host
    port = flags["health_port"] if flags["health_port"] is not None else port
    from restartkit.reference.model.layout import model_dir_ok
    if problem := model_dir_ok(layout.model):
        raise UsageError(problem)
    layout.check()
    return policy, layout, timeout, host, port


def wait_until_ready(layout, timeout: float, say, health: str | None = None) -> int:
    """Every local rank's socket answers ready, and, when the launcher serves a health endpoint
    (`health`: its URL), that says ready too: the launcher notices its ranks a moment after they serve."""
    from restartkit.weightcache import protocol
    from restartkit.weightcache.launcher import expected_uuids
    uuids = expected_uuids(layout)
    paths = [protocol.socket_path(u, draft, layout.socket_dir) for _, draft in layout.groups() for u in uuids]
    from restartkit.process.seam import Seam
    states: dict = {}

    def ready() -> bool:
        for p in paths:
            try:
                reply, fds = protocol.request(p, {"op": "ping"}, timeout=5.0, connect_timeout=2.0)
                protocol._close(fds)
                states[p] = reply.get("state")
            except (OSError, TimeoutError, protocol.ProtocolError):
                states[p] = "absent"
        return all(s == "ready" for s in states.values()) and (health is None or _healthy(health))
    if Seam().wait_until(ready, timeout, 0.2):
        say(f"weight cache ready: {len(paths)} rank(s)")
        return EXIT_SERVING
    say("not ready within the timeout: " + ", ".join(f"{p.name}: {s}" for p, s in states.items()))
    return EXIT_NOT_SERVING


def _healthy(url: str) -> bool:
    from restartkit import http
    try:
        return http.get(url, timeout=2).get("state") == "ready"
    except http.HTTPFailure:
        return False


def health_url(host: str, port: int | None) -> str | None:
    """The launcher's /health (None: it serves none)."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/health" if port else None


def detached(policy_path, flags: dict, say, state_root: str = "") -> int:
    """`restartkit preload --detach`: the launcher started in the background (its log in the state dir), and
    this returns once every local rank is ready: 0, else the launcher's exit code or EXIT_NOT_SERVING."""
    policy, layout, timeout, host, port = build(policy_path, flags, state_root)
    health = health_url(host, port)
    argv = [sys.executable, "-m", "restartkit.cli", "preload"] + _argv(policy_path, flags)
    if state_root:
        argv += ["--state-dir", state_root]
    state = (policy.state_dir() if policy else None)
    log_path = (state / "weightcache.log") if state else os.devnull
    if state:
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    rc = wait_until_ready(layout, timeout, say, health)
    if proc.poll() is not None:
        say(f"the launcher exited with code {proc.returncode}; log: {log_path}")
        return proc.returncode or EXIT_NOT_SERVING
    say(f"launcher PID {proc.pid}; log: {log_path}")
    return rc


def _argv(policy_path, flags) -> list[str]:
    out = ["--policy", str(policy_path)] if policy_path else []
    for k, v in flags.items():
        if v is None or v is False:
            continue
        opt = "--" + k.replace("_", "-")
        out += [opt] if v is True else [opt, str(v)]
    return out
