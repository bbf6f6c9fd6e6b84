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


def unit_dir(path: str) -> Path:
    """The directory units are written to, checked when one is written (never before: a command that only
    runs, in a unit under ProtectSystem=strict say, must not need it)."""
    d = Path(path)
    if not d.is_dir():
        raise UsageError(f"--unit-dir {path}: no such directory",
                         hint="make it, or pass --unit-dir with one (e.g. ~/.config/systemd/user)")
    if not os.access(d, os.W_OK):
        raise UsageError(f"--unit-dir {path} is not writable by this user",
                         hint="run the install as root, or pass --unit-dir with a directory you can write")
    return d


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


STATE_DIRECTORY = "/var/lib/restartkit"  # StateDirectory=restartkit


def environment(service, user: str | None = None) -> str:
    """Environment= lines for what the command line chose and the unit must keep (the state root:
    another one would be another lock, history and metrics); empty when nothing was chosen.  With
    `user` and no root chosen: StateDirectory=restartkit, which systemd makes for that user (their
    home may not exist: nobody's is /nonexistent), read back through $STATE_DIRECTORY."""
    if _state_directory(service, user):
        return "StateDirectory=restartkit\nStateDirectoryMode=0750\n"
    root = service.policy.state_root
    if not root:
        return ""
    return "Environment=" + quote(f"RESTARTKIT_STATE_DIR={os.path.abspath(os.path.expanduser(root))}") + "\n"


def state_root_for(service, user: str | None) -> str:
    """The state root the unit's commands use: what an operator passes to run the CLI as that user."""
    if _state_directory(service, user):
        return STATE_DIRECTORY
    return str(service.policy.state_dir().parent)


TMP_DIRS = ("/tmp", "/var/tmp")
# Seccomp: system call groups no engine, weight cache or supervise makes (torch's thread pinning is in
# @resources, its JIT in nothing listed; ptrace-like calls (@debug) are left for py-spy and the like)
DENIED_CALLS = "~@clock @cpu-emulation @module @mount @obsolete @raw-io @reboot @swap"
CRIU_UNHARDENED = """\
# Not hardened like a unit without CRIU: CRIU dumps and restores whole processes as root.  It needs
# CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE), CAP_SYS_PTRACE and CAP_NET_ADMIN, writes its images
# anywhere the policy says, creates namespaces for `snapshot test`, and restores mounts and devices:
# ProtectSystem=, PrivateDevices=, NoNewPrivileges=, RestrictNamespaces= or a capability bound would
# each fail a dump or a restore.
"""


def needs_criu(service) -> bool:
    return any(s.startswith("criu") for s in service.policy.restart["strategies"])


def writable_paths(service, user: str | None) -> list[str]:
    """What the service writes outside the unit's own directories: its state root (unless StateDirectory=
    gives one), the weight cache's sockets, the metrics textfiles."""
    from restartkit.policy import expand
    from restartkit.weightcache.protocol import socket_dir
    paths = [] if _state_directory(service, user) else [str(service.policy.state_dir().parent)]
    chosen = expand(service.policy.ipc["socket_dir"])
    if not chosen and user:  # the default is per user: the unit's user's, not the caller's
        import tempfile
        chosen = os.path.join(tempfile.gettempdir(), f"restartkit-wc-{pwd.getpwnam(user).pw_uid}")
    paths.append(socket_dir(chosen))
    if textfiles := service.policy.sections["metrics"]["textfile_dir"]:
        paths.append(expand(textfiles))
    return [os.path.abspath(p) for p in paths]


def make_writable_paths(service, user: str | None) -> None:
    """Make the ReadWritePaths= that do not exist yet (systemd skips a missing "-" path, and
    ProtectSystem=strict would then refuse the first write there), for the unit's user.  Those under
    /tmp are the daemons' to make at run time; a directory that exists is left as it is."""
    if needs_criu(service):
        return
    from restartkit.policy import expand
    textfiles = service.policy.sections["metrics"]["textfile_dir"]
    for path in writable_paths(service, user):
        if any(path == t or path.startswith(t + "/") for t in TMP_DIRS) or os.path.isdir(path):
            continue
        shared = bool(textfiles) and path == os.path.abspath(expand(textfiles))
        try:
            os.makedirs(path, mode=0o755 if shared else 0o700)  # the exporter reads the textfiles
            if user:
                entry = pwd.getpwnam(user)
                os.chown(path, entry.pw_uid, entry.pw_gid)
        except OSError as e:
            raise UsageError(f"cannot make {path}, which the unit writes: {e.strerror}",
                             hint="make it by hand for the unit's user, or choose another path in the policy") from None


def interpreter_paths() -> list[str]:
    """What a unit running this restartkit must reach: its script, this interpreter (a venv's links to
    its base one) and the installed package."""
    import restartkit
    paths = [_restartkit()[0], sys.executable, os.path.realpath(sys.executable),
             os.path.dirname(os.path.abspath(restartkit.__file__))]
    return list(dict.fromkeys(p for p in paths if os.path.isabs(p)))


def _reachable(path: str, uid: int, gids: set[int], need_x: bool = True) -> str | None:
    """The first directory on the way to `path` that `uid` (in `gids`, without root's override: a hardened
    unit has no CAP_DAC_OVERRIDE) cannot traverse, or `path` itself when it cannot read it (or, `need_x`, run
    it); None: it can."""
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        here = os.path.join(*parts[:i])
        try:
            st = os.stat(here)
        except OSError:
            return here
        bits = (st.st_mode >> 6 if st.st_uid == uid else st.st_mode >> 3 if st.st_gid in gids else st.st_mode) & 7
        if i < len(parts):
            if not bits & 1:  # a directory on the way: traversed
                return here
        elif not bits & 4 or (need_x or os.path.isdir(here)) and not bits & 1:  # the path itself: read (and run)
            return here
    return None


def reach_problem(service, user: str | None) -> str | None:
    """Why the unit could not start this restartkit (systemd's 203/EXEC, then a start-limit loop), or None:
    a private /tmp hides an interpreter under /tmp; the unit's user cannot reach one under a 0700 home."""
    if needs_criu(service):  # runs as root, unsandboxed
        return None
    private_tmp = not any(p == t or p.startswith(t + "/") for p in writable_paths(service, user) for t in TMP_DIRS)
    entry = pwd.getpwnam(user) if user else pwd.getpwuid(0)
    gids = {entry.pw_gid, *(g.gr_gid for g in _groups() if entry.pw_name in g.gr_mem)}
    model = os.path.abspath(os.path.expanduser(service.policy.service["model"]))
    if os.path.isdir(model):  # a local checkpoint (not a hub id): the engine reads every file of it
        if blocked := next((b for f in sorted(os.listdir(model)) if os.path.isfile(os.path.join(model, f))
                            and (b := _reachable(os.path.join(model, f), entry.pw_uid, gids, need_x=False))), None):
            return (f"{entry.pw_name} (the unit's user) cannot read the model: {blocked} is mode "
                    f"{os.stat(blocked).st_mode & 0o777:o} owned by uid {os.stat(blocked).st_uid} (chmod -R a+rX {model}, "
                    "or make the checkpoint readable by that user)")
    for path in interpreter_paths():
        hidden = next((t for t in TMP_DIRS if path == t or path.startswith(t + "/")), None)
        if private_tmp and hidden:
            return f"{path} is under {hidden}, which the unit's PrivateTmp=yes hides: systemd would fail it with 203/EXEC"
        if blocked := _reachable(path, entry.pw_uid, gids):
            return (f"{entry.pw_name} (the unit's user, without root's override) cannot reach {path}: {blocked} is "
                    f"mode {os.stat(blocked).st_mode & 0o777:o} owned by uid {os.stat(blocked).st_uid}"
                    if os.path.exists(blocked) else f"{blocked} does not exist")
    return None


def _groups():
    import grp
    return grp.getgrall()


def check_reach(service, user: str | None) -> None:
    if problem := reach_problem(service, user):
        raise UsageError(f"the unit could not start restartkit: {problem}; no unit was written",
                         hint="put restartkit (a venv: python3 -m venv /opt/restartkit/venv) and the model where the "
                              "unit's user can reach them (e.g. under /opt and /srv), then run --install-unit with "
                              "that venv's restartkit")


def hardening(service, user: str | None) -> str:
    """The sandbox of a unit without CRIU (systemd-analyze security scores it about 2-3, where a unit
    without any scored 9.6): read-only system and homes but for what it writes, no capabilities, no new
    privileges.  A GPU needs its /dev/nvidia* nodes (PrivateDevices=no); the weight cache's sockets
    default to /tmp, shared with the engine's unit (PrivateTmp=no then: a private /tmp per unit would
    hide them)."""
    if needs_criu(service):
        return CRIU_UNHARDENED
    paths = writable_paths(service, user)
    in_tmp = sorted({t for p in paths for t in TMP_DIRS if p == t or p.startswith(t + "/")})
    rw = [t for t in in_tmp] + [f"-{p}" for p in paths if not any(p == t or p.startswith(t + "/") for t in in_tmp)]
    gpu = service.policy.service["device"] == "cuda"
    lines = [
        "NoNewPrivileges=yes", "ProtectSystem=strict", *(f"ReadWritePaths={quote(p)}" for p in rw),
        "ProtectHome=read-only",
        (f"PrivateTmp=no\n# PrivateTmp=no: {', '.join(p for p in paths if any(p.startswith(t) for t in in_tmp))} "
         "is shared with the other units (set [ipc] socket_dir outside /tmp to get a private /tmp)") if in_tmp
        else "PrivateTmp=yes",
        "PrivateDevices=no\n# PrivateDevices=no: the GPU's /dev/nvidia* nodes (CUDA, CUDA IPC)" if gpu
        else "PrivateDevices=yes",
        "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectKernelLogs=yes", "ProtectControlGroups=yes",
        "ProtectClock=yes", "ProtectHostname=yes", "RestrictRealtime=yes", "RestrictSUIDSGID=yes",
        "RestrictNamespaces=yes", "LockPersonality=yes", "SystemCallArchitectures=native",
        f"SystemCallFilter={DENIED_CALLS}",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",  # AF_NETLINK: gloo's interface lookup
        "CapabilityBoundingSet=", "AmbientCapabilities=", "UMask=0077",
        # caches of engines that compile (vLLM, torch inductor): a directory of the unit's own
        "CacheDirectory=restartkit", "Environment=XDG_CACHE_HOME=%C/restartkit",
    ]
    return "# sandbox (restartkit.systemd.units.hardening)\n" + "\n".join(lines) + "\n"


def _state_directory(service, user: str | None) -> bool:
    """A unit for another user keeps its state in StateDirectory=restartkit (/var/lib/restartkit, made
    and owned for that user by systemd) unless the command line or the policy chose a root."""
    return bool(user) and not service.policy.state_root and not service.policy.sections["service"]["state_dir"]


def engine_unit(name: str) -> str:
    return f"restartkit-{name}.service"


def cache_unit(name: str) -> str:
    return f"restartkit-wc-{name}.service"


def socket_unit(name: str) -> str:
    return f"restartkit-{name}.socket"


def listen_stream(host: str, port: int) -> str:
    """ListenStream= for host:port (an IPv6 address in brackets, systemd.socket(5))."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def supervise_units(service, unit_dir_path: str, watchdog_s: int = 0, user: str | None = None) -> tuple[Path, Path]:
    """restartkit-<name>.socket and restartkit-<name>.service: systemd holds the service's listening socket
    (it outlives supervise too) and passes it to `restartkit supervise` (LISTEN_FDS), which serves every
    engine on it; the service comes after its weight cache's unit when that one is installed beside it;
    `user`: User= (policies without CRIU only)."""
    start = exec_line(["supervise", "--policy", os.path.abspath(service.policy.path)])
    reload = exec_line(["reload", "--policy", os.path.abspath(service.policy.path), "--pid"]) + " $MAINPID"
    r = service.policy.restart
    name = service.policy.name
    d = unit_dir(unit_dir_path)
    check_reach(service, user)
    cache = (d / cache_unit(name)).exists()
    _same_user(d / cache_unit(name), user, "its weight cache's unit")
    make_writable_paths(service, user)
    path = d / engine_unit(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = d / socket_unit(name)
    sock.write_text(f"""[Unit]
Description=restartkit: the listening socket of {name} (connections wait here while an engine is replaced)

[Socket]
ListenStream={listen_stream(*(service.policy.public or (service.policy.service["host"], service.policy.service["port"])))}
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
{START_LIMIT}
[Service]
Type=notify
NotifyAccess=main
{_user(service, user)}{environment(service, user)}{hardening(service, user)}ExecStart={start}
# returns when the planned restart is done, with its outcome (systemd 252 has no Type=notify-reload)
ExecReload={reload}
KillMode=mixed
# floors: supervise extends both to the policy's numbers at the time (EXTEND_TIMEOUT_USEC)
# (systemd times ExecReload= by TimeoutStartSec= too: the reload command's own deadline is 30 s shorter)
TimeoutStartSec={int(r['stop_timeout_s'] + r['start_timeout_s'] + 90)}
TimeoutStopSec={int(r['stop_timeout_s'] + 30)}
{f'WatchdogSec={watchdog_s}' if watchdog_s else '# WatchdogSec=60  (supervise feeds it while its loop makes progress)'}
Restart=on-failure
RestartSec=5
{GIVE_UP}
[Install]
WantedBy=multi-user.target
""")
    return sock, path


def weight_cache_unit(service, unit_dir_path: str, user: str | None = None) -> Path:
    """restartkit-wc-<name>.service: the weight-cache daemons (`restartkit preload`), active only once
    they hold the weights (ExecStartPost waits), ordered before the engine's unit."""
    policy = os.path.abspath(service.policy.path)
    name = service.policy.name
    d = unit_dir(unit_dir_path)
    check_reach(service, user)
    path = d / cache_unit(name)
    _same_user(d / engine_unit(name), user, "its engine's unit")
    make_writable_paths(service, user)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""[Unit]
Description=restartkit: the weight cache of {name} (its engine's unit starts once it holds the weights)
Wants=network-online.target
After=network-online.target
Before={engine_unit(name)}
{START_LIMIT}
[Service]
Type=exec
{_user(service, user)}{environment(service, user)}{hardening(service, user)}ExecStart={exec_line(["preload", "--policy", policy])}
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


# A unit that fails at once RestartSec after RestartSec trips this (5 starts in 25 s), so a loop ends
START_LIMIT = "StartLimitIntervalSec=300\nStartLimitBurst=5\n"
# supervise's give-up (its own start limit, EXIT_GAVE_UP): the engine cannot be brought back, and
# another supervise would not either; the service stays stopped until an operator acts
GIVE_UP = "RestartPreventExitStatus=1\n"


def _same_user(other: Path, user: str | None, what: str) -> None:
    """The engine and its weight cache run as one user: the cache hands its memory to its own user's
    processes only (SO_PEERCRED), and both share the socket directory."""
    if not other.exists():
        return
    theirs = next((ln.split("=", 1)[1].strip().strip('"') for ln in other.read_text().splitlines()
                   if ln.startswith("User=")), None)
    if theirs != (user or None):
        raise UsageError(f"{other} runs as {theirs or 'root'}, this unit would run as {user or 'root'}: the weight "
                         "cache serves its own user's engines only",
                         hint=f"install both with the same --user (or remove {other} first)")


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
