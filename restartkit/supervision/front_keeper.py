"""The service's front (restartkit.front), kept by supervise unless the policy's [front] enabled is false: the
listening socket clients use ([service] host and port, or systemd's) held for supervise's whole life (a front
that dies loses the requests in flight on it, never a connection: new ones wait in the socket's queue), the front
started on it, and started again whenever it exits (a thread waits on it).  The engines serve behind it on a
loopback port (Policy.behind_front).  The front dies with supervise (its parent-death signal)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from restartkit.errors import UsageError
from restartkit.process.engine import describe_exit

RESTART_PAUSE_S = 0.2  # between a front's exit and the next start: a front that cannot start is not a busy loop


class FrontKeeper:
    def __init__(self, service, say: Callable[[str], None]):
        self.service, self.say = service, say
        self.cfg = service.policy.front
        self.port, self.source = 0, "supervise"
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._stopping = threading.Event()

    @property
    def wanted(self) -> bool:
        return self.service.policy.public is not None  # the engines serve behind the front (Policy.behind_front)

    def start(self, passed=None) -> None:
        """The front on systemd's socket (`passed`, restartkit.process.listener.Held) or on the policy's
        address, bound here."""
        if not self.wanted:
            return
        from restartkit.process import listener
        host, port = self.service.policy.public
        path = self.service.policy.path
        if passed is not None:
            if why := listener.matches(passed, host, port):
                raise UsageError(why, hint=f"make the .socket unit's ListenStream= the policy's address "
                                           f"({host}:{port}) or change {path}")
            self.sock, self.source = passed.sock, "systemd"
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            try:
                self.sock = socket.create_server((host or "0.0.0.0", port), family=family, backlog=4096)
            except OSError as e:
                from restartkit.process.procfs import listeners
                who = "".join(f" (PID {p} listens there)" for p in listeners(port)[:1])
                raise UsageError(f"cannot bind {host or '0.0.0.0'}:{port}, where the front answers the service's "
                                 f"clients: {e.strerror or e}{who}",
                                 hint=f"stop that process, or change [service] port in {path}") from None
        self.port = port
        self.sock.set_inheritable(True)
        self._spawn()
        threading.Thread(target=self._keep, name="front-keeper", daemon=True).start()

    def _spawn(self) -> None:
        engine = self.service.adapter.base_url(self.service.policy)
        log = open(self.service.state_dir / "front.log", "ab")  # noqa: SIM115 (the child holds it)
        fd = self.sock.fileno()
        with log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "restartkit.front", "--fd", str(fd), "--upstream", engine,
                 "--wait-s", str(self.cfg["wait_s"]), "--max-in-flight", str(self.cfg["max_in_flight"]),
                 "--counts-file", str(self.counts_file)],
                pass_fds=(fd,), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent)
        self.starts += 1
        self.say(f"{self.service.policy.name}: front PID {self.proc.pid} answering on port {self.port} "
                 f"({self.source}) for the engines on {engine} (its log: {self.service.state_dir / 'front.log'})")

    def _keep(self) -> None:
        while not self._stopping.is_set():
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            self.say(f"{self.service.policy.name}: the front (PID {self.proc.pid}) {describe_exit(code)}; starting "
                     f"it again ({self._in_flight()} request(s) in flight on it were lost, counted in "
                     "restartkit_front_requests_lost_with_front_total; new connections wait in its queue)")
            time.sleep(RESTART_PAUSE_S)
            if not self._stopping.is_set():
                self._spawn()

    @property
    def counts_file(self):
        return self.service.state_dir / "front.counts.json"

    def _in_flight(self) -> int | str:
        try:
            return int(json.loads(self.counts_file.read_text())["in_flight"])
        except (OSError, ValueError, KeyError, TypeError):
            return "an unknown number of"

    def describe(self) -> dict | None:
        if not self.wanted or self.proc is None:
            return None
        return {"pid": self.proc.pid, "port": self.port, "source": self.source,
                "engine_port": self.service.policy.service["port"], "starts": self.starts}

    def stop(self) -> None:
        self._stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.sock is not None:
            self.sock.close()


def _die_with_parent() -> None:
    from restartkit.process.signals import set_parent_death_signal
    set_parent_death_signal()  # supervise gone, the front goes too
    os.setpgid(0, 0)  # not in supervise's process group: a signal to the group is supervise's to pass on
