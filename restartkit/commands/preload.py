"""`restartkit preload`: policy + flags -> a layout -> the launcher (foreground, detached, or only waiting for one
that runs)."""
from __future__ import annotations

from restartkit.weightcache.prelaunch import build, detached, health_url, wait_until_ready


def preload_command(policy_path, flags: dict, detach: bool, wait_ready: bool, say, state_root: str = "") -> int:
    from restartkit.weightcache.launcher import Launcher, run
    policy, layout, timeout, host, port = build(policy_path, flags, state_root)
    if policy is not None and not wait_ready:
        from restartkit.policy.warnings import warnings
        for w in warnings(policy):
            say(f"warning: {w}")
    if wait_ready:
        return wait_until_ready(layout, timeout, say, health_url(host, port))
    if detach:
        return detached(policy_path, flags, say, state_root)
    return run(Launcher(layout, timeout, host, port, say=say))
