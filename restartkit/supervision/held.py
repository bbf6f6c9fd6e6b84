"""The service's listening socket, held by supervise for its whole life so that it outlives every engine, the
broker that offers it to restartkit's other commands (restartkit.process.listener), and the front's socket and
process where the policy asks for a front (restartkit.supervision.front_keeper)."""
from __future__ import annotations

from typing import Callable

from restartkit.errors import UsageError


class HeldSocket:
    def __init__(self, service, say: Callable[[str], None]):
        from restartkit.supervision.front_keeper import FrontKeeper
        self.service, self.say = service, say
        self.broker = None
        self.front = FrontKeeper(service, say)

    def hold(self) -> None:
        """The engines' socket, then the front's (when the engines serve behind one).  systemd's socket (socket
        activation) is the one clients use: the front's when there is a front, else the engines'."""
        from restartkit.process import listener
        passed = listener.from_systemd()
        if self.front.wanted:
            self._hold_service(None)
            self.front.start(passed)
        else:
            self._hold_service(passed)

    def _hold_service(self, passed) -> None:
        """systemd's socket (`passed`), or one bound here.  An engine found serving on a socket of its own
        keeps it; the port is held once that one is gone."""
        from restartkit.process import listener
        svc, s = self.service, self.service.policy.service
        if not getattr(svc.adapter, "serves_on_socket", False):
            if passed is not None:
                raise UsageError(f"{svc.adapter.label} cannot serve on the socket systemd passed (LISTEN_FDS)",
                                 hint="start this service without its .socket unit; it binds the port itself")
            return
        if passed is not None:
            if why := listener.matches(passed, s["host"], s["port"]):
                raise UsageError(f"{why}", hint=f"make the .socket unit's ListenStream= the policy's address "
                                                f"({s['host']}:{s['port']}) or change {svc.policy.path}")
            svc.engine.held = passed
        else:
            svc.engine.hold = True
            svc.engine.listener()
        self.offer()

    def offer(self) -> None:
        """Once a socket is held: hand it to restartkit's other commands through the broker (once)."""
        from restartkit.process import listener
        held = self.service.engine.held
        if held is None or self.broker is not None:
            return
        try:
            self.broker = listener.Broker(self.service.state_dir, held)
        except listener.ListenerError as e:  # an engine would take its socket back from a squatter: refused
            raise UsageError(f"cannot start: {e.strerror}",
                             hint="stop the other supervise of this service (restartkit status names it), or the "
                                  "process that holds the name") from None
        except OSError as e:
            self.say(f"restartkit supervise: cannot offer the held socket to other commands ({e.strerror or e}); "
                     "a `restartkit restart` run beside supervise binds the port itself")
        d = held.describe()
        self.say(f"{self.service.policy.name}: holding {d['address']} ({d['source']}; up to {d['backlog']} "
                 "connections wait in its queue while no engine accepts)")

    def describe(self) -> dict | None:
        held = self.service.engine.held
        out = held.describe() if held is not None else None
        if (front := self.front.describe()) is not None:
            out = {**(out or {}), "front": front}
        return out

    def close(self) -> None:
        if self.broker is not None:
            self.broker.close()
        self.front.stop()
