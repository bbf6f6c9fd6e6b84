"""Engine side: `--load-format ipc_cache`.  Attach to this device's daemon,
map the arena, build the model on it; or fall back to disk and say why.

Config keys (anything else is an error): mode zero_copy|copy, fallback (a
real boolean), connect_timeout_s (5.0), state_timeout_s (300.0), socket_dir.

fallback on: a missing daemon or a fingerprint mismatch goes to disk at once
(recorded as fallback(reason)); a daemon that is still loading is waited for
up to state_timeout_s, since it will be ready soon and faster than the disk.
fallback off: wait for the daemon up to state_timeout_s; any failure stops
the start, naming the reason.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields

from restartkit.process.seam import Seam
from restartkit.weightcache import protocol


class IPCUnavailable(Exception):
    def __init__(self, reason: str, field: str | None = None, retry: bool = False):
        super().__init__(reason)
        self.reason, self.field, self.retry = reason, field, retry


@dataclass
class IPCConfig:
    mode: str = "zero_copy"
    fallback: bool = True
    connect_timeout_s: float = 5.0
    state_timeout_s: float = 300.0
    socket_dir: str = ""

    @classmethod
    def parse(cls, raw: dict) -> "IPCConfig":
        unknown = set(raw) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown ipc_cache key(s): {', '.join(sorted(unknown))}; allowed: {', '.join(DEFAULTS)}")
        cfg = {**DEFAULTS, **raw}
        if cfg["mode"] not in ("zero_copy", "copy"):
            raise ValueError(f"ipc_cache mode {cfg['mode']!r}: allowed zero_copy, copy")
        if not isinstance(cfg["fallback"], bool):
            raise ValueError(f"ipc_cache fallback must be true or false, not {cfg['fallback']!r}")
        for k in ("connect_timeout_s", "state_timeout_s"):
            if isinstance(cfg[k], bool) or not isinstance(cfg[k], (int, float)) or cfg[k] <= 0:
                raise ValueError(f"ipc_cache {k} must be a positive number, not {cfg[k]!r}")
        return cls(**cfg)


# The loader's config keys and their defaults, declared once (the fields above); the policy's
# [ipc] section and the engine adapters pass exactly these.
DEFAULTS = {f.name: f.default for f in fields(IPCConfig)}
LOADER_KEYS = tuple(DEFAULTS)


def _attach_once(path, hello: dict, cfg: IPCConfig) -> tuple[dict, list[int]]:
    try:
        reply, fds = protocol.request(path, {**hello, "op": "attach", "mode": cfg.mode},
                                      timeout=max(30.0, cfg.connect_timeout_s), connect_timeout=cfg.connect_timeout_s)
    except FileNotFoundError:
        raise IPCUnavailable(f"no weight-cache daemon for this device (no socket {path})", retry=True) from None
    except ConnectionRefusedError:
        raise IPCUnavailable(f"stale socket {path}: no daemon listens", retry=True) from None
    except (ConnectionError, TimeoutError, OSError, protocol.ProtocolError) as e:
        raise IPCUnavailable(f"could not talk to the daemon at {path}: {e}", retry=True) from None
    if not reply.get("ok"):
        protocol._close(fds)
        err = reply.get("error")
        if err == "fingerprint":
            fields = [d["field"] for d in reply["differences"]]
            raise IPCUnavailable(f"the daemon refused: {reply['message']}", field=",".join(fields))
        raise IPCUnavailable(f"the daemon refused ({err}): {reply.get('message')}", field=err,
                             retry=err in ("loading", "starting"))
    return reply, fds


def _attach_waiting(path, hello: dict, cfg: IPCConfig, absent_timeout_s: float | None) -> dict:
    """Ask the daemon until it hands the weights over ({"reply": (reply, fds)}) or refuses in a way
    not worth waiting out ({"error": IPCUnavailable}): a loading daemon is waited for up to
    state_timeout_s, an absent one (fallback off) too, or only `absent_timeout_s`."""
    got: dict = {}
    seam = Seam()
    absent_since: list[float] = []  # when the daemon was first found absent (no socket, nobody listening)

    def attached() -> bool:  # True: attached, or a refusal not worth waiting out
        try:
            got["reply"] = _attach_once(path, hello, cfg)
            return True
        except IPCUnavailable as e:
            got["error"] = e
            loading = e.field in ("loading", "starting")
            if e.retry and not loading and absent_timeout_s is not None:
                absent_since[:] = absent_since or [seam.clock()]
                if seam.clock() - absent_since[0] >= absent_timeout_s:
                    return True  # a daemon that should be serving is gone: waiting will not bring it
            return not ((not cfg.fallback and e.retry) or (cfg.fallback and loading))
    seam.wait_until(attached, cfg.state_timeout_s, 0.5)
    return got


def attach(engine, raw_config: dict, device_uuid: str, fingerprint: dict, draft: bool = False,
           absent_timeout_s: float | None = None) -> None:
    """Fill `engine` from the daemon (the draft group's when `draft`), or from disk when
    allowed; records the result in engine.load_info (ipc = hit | fallback, and why).
    `absent_timeout_s`: how long a daemon that is not there at all is waited for (a re-attach
    after a restore: the cache served when the snapshot was taken; None: state_timeout_s)."""
    import torch

    from restartkit.weightcache.arena import open_cuda, open_memfd, views

    cfg = IPCConfig.parse(raw_config)
    path = protocol.socket_path(device_uuid, draft, cfg.socket_dir)
    hello = {"protocol": protocol.PROTOCOL_VERSION, "device_uuid": device_uuid, "fingerprint": fingerprint}
    t0 = time.perf_counter()
    got = _attach_waiting(path, hello, cfg, absent_timeout_s)
    if "reply" not in got:
        e = got["error"]
        if not cfg.fallback:
            raise RuntimeError(f"ipc_cache: {e.reason} (fallback is off)") from None
        engine.load_from_disk()
        engine.load_info.update(ipc="fallback", fallback_reason=e.reason, fallback_field=e.field)
        print(f"[engine {os.getpid()}] weight cache unusable ({e.reason}); loaded from disk", flush=True)
        return
    reply, fds = got["reply"]
    t_reply = time.perf_counter()
    handle = reply["handle"]
    if handle["kind"] == "memfd":
        data, mm = open_memfd(fds[0], handle["nbytes"], writable=cfg.mode == "copy")
        os.close(fds[0])
        engine._ipc_mapping = mm  # keeps the mapping alive as long as the engine
    else:
        data = open_cuda(handle)
    t_open = time.perf_counter()
    if cfg.mode == "copy":
        data = data.clone()
        engine._ipc_mapping = None
        try:
            protocol.request(path, {"op": "detach"}, timeout=5.0, connect_timeout=cfg.connect_timeout_s)
        except Exception:
            pass
    named = views(data, reply["manifest"])
    t_views = time.perf_counter()
    engine.install(named, {"source": "ipc", "ipc": "hit", "mode": cfg.mode, "socket": str(path),
                           "attach_s": round(t_open - t0, 4), "handle_open_s": round(t_open - t_reply, 4),
                           "views_s": round(t_views - t_open, 4), "nbytes": handle["nbytes"]})
    engine.load_info["install_s"] = round(time.perf_counter() - t_views, 4)
    if data.device.type == "cuda":
        torch.cuda.synchronize()
    print(f"[engine {os.getpid()}] mapped {len(named)} tensors from the weight cache daemon ({cfg.mode} mode) "
          f"in {time.perf_counter() - t0:.3f} s", flush=True)
