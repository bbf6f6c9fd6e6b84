"""The systemd units restartkit writes: the engine's and its listening socket's (supervise --install-unit), its weight
cache's (preload --install-unit: ready before the engine's unit starts), and the snapshot refresh's
timer (restartkit.snapshot.refresh).  Each runs the restartkit the user ran, with the state root the
command line chose, its arguments quoted by systemd's rules (a policy path with a space stays one
argument; nothing in it adds a line or expands a specifier).  Timeouts are floors: supervise extends
them (EXTEND_TIMEOUT_USEC) to what the policy says when it runs, so a policy that later allows a
longer start is not cut by a unit written before."""
from __future__ import annotations

import os
import pwd
import shutil
import sys
from pathlib import Path

from restartkit.errors import UsageError
from restartkit.process.listener import BACKLOG

PLAIN = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-+=:,@")


def quote(arg: str) -> str:
    """One argument of an Exec*= line: as it is when plain, else in double quotes with backslashes and
    quotes escaped, and % and $ doubled (systemd would expand specifiers and variables)."""
    if arg and set(arg) <= PLAIN:
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def exec_line(args: list[str]) -> str:
    """An Exec*= value running restartkit with `args`; refuses what a unit cannot carry (a newline,
    any control character) naming it."""
    return " ".join(quote(a) for a in _checked(_restartkit() + list(args), "a systemd unit"))


def cron_command(args: list[str]) -> str:
    """The command of a crontab line running restartkit with `args`: quoted for /bin/sh, with % escaped
    (cron turns an unescaped % into a newline)."""
    import shlex
    return " ".join(shlex.quote(a).replace("%", "\\%") for a in _checked(_restartkit() + list(args), "a crontab line"))


def _checked(argv: list[str], where: str) -> list[str]:
    for a in argv:
        if any(ord(c) < 32 or ord(c) == 127 for c in a):
            raise UsageError(f"{a!r} holds a newline or another control character: {where} cannot carry it",
                             hint="move the policy file (or restartkit) to a path without one")
    return argv


def _restartkit() -> list[str]:
    """The restartkit the user ran (this interpreter's), not whichever is first on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "restartkit")
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which("restartkit")
    return [found] if found else [sys.executable, "-m", "restartkit.cli"]


def environment(service, user: str | None = None) -> str:
    """Environment= lines for what the command line chose and the unit must keep (the state root:
    another one would be another lock, history and metrics); empty when nothing was chosen.  With
    `user`, the root is pinned even when not chosen: that user's home is not the caller's."""
    root = service.policy.state_root
    if not root and user and not service.policy.sections["service"]["state_dir"]:
        root = os.path.join(pwd.getpwnam(user).pw_dir, ".local", "state", "restartkit")
    if not root:
        return ""
    return "Environment=" + quote(f"RESTARTKIT_STATE_DIR={os.path.abspath(os.path.expanduser(root))}") + "\n"


def engine_unit(name: str) -> str:
    return f"restartkit-{name}.service"


def cache_unit(name: str) -> str:
    return f"restartkit-wc-{name}.service"


def socket_unit(name: str) -> str:
    return f"restartkit-{name}.socket"


def listen_stream(host: str, port: int) -> str:
    """ListenStream= for host:port (an IPv6 address in brackets, systemd.socket(5))."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def supervise_units(service, unit_dir: str, watchdog_s: int = 0, user: str | None = None) -> tuple[Path, Path]:
    """restartkit-<name>.socket and restartkit-<name>.service: systemd holds the service's listening socket
    (it outlives supervise too) and passes it to `restartkit supervise` (LISTEN_FDS), which serves every
    engine on it; the service comes after its weight cache's unit when that one is installed beside it;
    `user`: User= (policies without CRIU only)."""
    start = exec_line(["supervise", "--policy", os.path.abspath(service.policy.path)])
    r = service.policy.restart
    name = service.policy.name
    d = Path(unit_dir)
    cache = (d / cache_unit(name)).exists()
    path = d / engine_unit(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = d / socket_unit(name)
    sock.write_text(f"""[Unit]
Description=restartkit: the listening socket of {name} (connections wait here while an engine is replaced)

[Socket]
ListenStream={listen_stream(service.policy.service["host"], service.policy.service["port"])}
Backlog={BACKLOG}
NoDelay=true

[Install]
WantedBy=sockets.target
""")
    path.write_text(f"""[Unit]
Description=restartkit: {name}, supervised (crashes come back through the fastest proven path)
Requires={socket_unit(name)}
Wants=network-online.target{f" {cache_unit(name)}" if cache else ""}
After=network-online.target {socket_unit(name)} {cache_unit(name)}

[Service]
Type=notify
NotifyAccess=main
{_user(service, user)}{environment(service, user)}ExecStart={start}
ExecReload=/bin/kill -HUP $MAINPID
KillMode=mixed
# floors: supervise extends both to the policy's numbers at the time (EXTEND_TIMEOUT_USEC)
TimeoutStartSec={int(r['stop_timeout_s'] + r['start_timeout_s'] + 60)}
TimeoutStopSec={int(r['stop_timeout_s'] + 30)}
{f'WatchdogSec={watchdog_s}' if watchdog_s else '# WatchdogSec=60  (supervise feeds it while its loop makes progress)'}
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
""")
    return sock, path


def weight_cache_unit(service, unit_dir: str, user: str | None = None) -> Path:
    """restartkit-wc-<name>.service: the weight-cache daemons (`restartkit preload`), active only once
    they hold the weights (ExecStartPost waits), ordered before the engine's unit."""
    policy = os.path.abspath(service.policy.path)
    name = service.policy.name
    path = Path(unit_dir) / cache_unit(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""[Unit]
Description=restartkit: the weight cache of {name} (its engine's unit starts once it holds the weights)
Wants=network-online.target
After=network-online.target
Before={engine_unit(name)}

[Service]
Type=exec
{_user(service, user)}{environment(service, user)}ExecStart={exec_line(["preload", "--policy", policy])}
ExecStartPost={exec_line(["preload", "--policy", policy, "--wait-ready"])}
TimeoutStartSec={int(service.policy.ipc["startup_timeout_s"] + 60)}
TimeoutStopSec=30
KillMode=mixed
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
""")
    return path


def _user(service, user: str | None) -> str:
    """User= for a unit that need not run as root: refused for a policy that lists a CRIU strategy."""
    if not user:
        return ""
    wants = [s for s in service.policy.restart["strategies"] if s.startswith("criu")]
    if wants:
        raise UsageError(f"{service.policy.path} lists {wants[0]}, which needs root: a unit with User={user} "
                         "could never run it", hint="drop --user, or the CRIU strategies from [restart] strategies")
    try:
        pwd.getpwnam(user)
    except KeyError:
        raise UsageError(f"no user {user!r} on this machine", hint="create it first (useradd --system ...)") from None
    return "User=" + quote(user) + "\n"
