"""One weight-cache daemon: one device, one rank's processed weights.

Lifecycle: take the per-device lock (a second daemon for the same device
fails at once) -> bind the socket (clients see "loading") -> load, process,
pack into one arena -> "ready" -> serve until SIGTERM/SIGINT -> remove the
socket and lock, free the memory.  A parent-death signal stops it with its
launcher.  Progress goes to stdout as JSON lines for the launcher.

Requests (JSON): hello, attach, detach, ping, stats, release, stop.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from restartkit.process.signals import block_stop_signals, next_stop_signal, set_parent_death_signal
from restartkit.weightcache import protocol
from restartkit.weightcache.fingerprint import CHECKPOINT, describe, differences

def emit(event: str, **kw) -> None:
    print(json.dumps({"event": event, "pid": os.getpid(), **kw}), flush=True)


def device_uuid(device: str, global_rank: int) -> str:
    """The identity a socket is named after and an engine must match."""
    if device.startswith("cuda"):
        import torch
        idx = int(device.split(":")[1]) if ":" in device else 0
        return f"GPU-{torch.cuda.get_device_properties(idx).uuid}"
    mid = (Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").exists() else "host")[:12]
    return f"cpu-{mid}-rank{global_rank}"


class Daemon:
    def __init__(self, args):
        self.args = args
        self.state = "starting"
        self.arena = None
        self.fingerprint: dict = {}
        self.attached: dict[int, str] = {}  # pid -> mode
        self.lock = threading.Lock()
        self.started = time.time()
        self.load_s = None
        self.uuid = args.device_uuid
        self.stop_event = threading.Event()

    # ---- requests ---------------------------------------------------------------
    def handle(self, msg: dict, peer_pid: int) -> tuple[dict | bytes, list[int]]:
        op = msg.get("op")
        if op == "ping":
            return {"ok": True, "state": self.state}, []
        if op == "stats":
            return {"ok": True, **self.stats()}, []
        if op in ("hello", "attach"):
            return self.check_and_attach(msg, peer_pid, attach=op == "attach")
        if op == "detach":
            with self.lock:
                self.attached.pop(peer_pid, None)
            return {"ok": True}, []
        if op in ("release", "stop"):
            busy = self.zero_copy_users()
            if busy and not msg.get("force"):
                return {"ok": False, "error": "in_use",
                        "message": f"engines {busy} map these weights (zero_copy); stop them first or pass force"}, []
            if op == "release":
                self.release()
                return {"ok": True, "state": self.state}, []
            self.stop_event.set()
            return {"ok": True, "state": "stopping"}, []
        return {"ok": False, "error": "bad_request", "message": f"unknown op {op!r}"}, []

    def check_and_attach(self, msg: dict, peer_pid: int, attach: bool) -> tuple[dict, list[int]]:
        if msg.get("protocol") != protocol.PROTOCOL_VERSION:
            return {"ok": False, "error": "protocol", "message": f"protocol {msg.get('protocol')} != {protocol.PROTOCOL_VERSION}"}, []
        if msg.get("device_uuid") != self.uuid:
            return {"ok": False, "error": "device", "message": f"this daemon serves {self.uuid}, the engine runs on {msg.get('device_uuid')}"}, []
        if self.state != "ready":
            return {"ok": False, "error": self.state, "message": f"the daemon is {self.state}"}, []
        diffs = differences(self.fingerprint, msg.get("fingerprint") or {})
        if diffs:
            return {"ok": False, "error": "fingerprint", "differences": diffs, "message": describe(diffs)}, []
        if not attach:
            return {"ok": True}, []
        mode = msg.get("mode", "zero_copy")
        with self.lock:
            self.attached[peer_pid] = mode
            handle = self.arena.handle()
            fds = [self.arena.memfd] if self.arena.memfd is not None else []
        return protocol.encode({"ok": True, "handle": handle, "mode": mode}, {"manifest": self.wire_manifest}), fds

    def zero_copy_users(self) -> list[int]:
        with self.lock:
            for pid in [p for p in self.attached if not _alive(p)]:
                del self.attached[pid]  # engines that exited no longer count
            return sorted(p for p, m in self.attached.items() if m == "zero_copy")

    def stats(self) -> dict:
        return {"state": self.state, "device_uuid": self.uuid, "device": self.args.device,
                "fingerprint": self.fingerprint, "nbytes": self.arena.nbytes if self.arena else 0,
                "tensors": len(self.arena.manifest) if self.arena else 0, "attached": self.zero_copy_users(),
                "load_s": self.load_s, "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1)}

    def release(self) -> None:
        with self.lock:
            if self.arena is not None:
                self.arena.close()
                self.arena = None
            self.state = "released"

    # ---- loading --------------------------------------------------------------------
    def load(self) -> None:
        import torch

        from restartkit.reference.model.checkpoint import DTYPES
        from restartkit.reference.model.llama import ModelConfig, Parallel, check_parallel
        from restartkit.reference.model.weights import processed_weights
        from restartkit.weightcache.arena import pack, to_wire
        from restartkit.weightcache.fingerprint import fingerprint

        a = self.args
        t0 = time.perf_counter()
        device = torch.device(a.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        fp = fingerprint(a.model, tp_size=a.tp_size, tp_rank=a.tp_rank, dp_size=a.dp_size, dp_rank=a.dp_rank,
                         expert_parallel=a.expert_parallel, dtype=a.dtype, quantization=a.quantization,
                         revision=a.revision, draft=a.draft)
        if a.dtype == CHECKPOINT:  # another engine's cache: the checkpoint's tensors as stored, it shards them itself
            tensors = list(checkpoint_tensors(a.model, str(device)))
        else:
            cfg = ModelConfig.load(a.model)
            par = Parallel(tp_size=a.tp_size, tp_rank=a.tp_rank, expert_parallel=a.expert_parallel)
            if problem := check_parallel(cfg, par):
                raise ValueError(problem)
            tensors = list(processed_weights(a.model, cfg, par, DTYPES[a.dtype], a.quantization, str(device)))
        arena = pack(tensors, device)
        del tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with self.lock:
            wire = json.dumps(to_wire(arena.manifest), separators=(",", ":")).encode()
            self.arena, self.fingerprint, self.wire_manifest = arena, fp, wire
            self.load_s = round(time.perf_counter() - t0, 3)
            self.state = "ready"


def checkpoint_tensors(model: str, device: str):
    """(name, tensor) of every safetensors shard of `model`, as stored (names, dtypes, shapes): the
    layout of an engine that loads the checkpoint itself (vLLM through restartkit's load format)."""
    from safetensors import safe_open

    from restartkit.reference.model.layout import shard_files
    for path in shard_files(model):
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _alive(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Server(threading.Thread):
    """Accept loop; one thread per client; several requests per connection."""

    def __init__(self, daemon: Daemon, path: Path):
        super().__init__(daemon=True)
        self.d, self.path = daemon, path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self.sock.listen(64)

    def run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        with conn:
            pid, uid, _gid = protocol.peer_credentials(conn)
            if uid != os.getuid():
                try:
                    protocol.send(conn, {"ok": False, "error": "permission",
                                         "message": f"uid {uid} may not use the weight cache of uid {os.getuid()}"}, timeout=5)
                except OSError:
                    pass
                return
            while True:
                try:
                    msg, fds = protocol.recv(conn, timeout=30.0)
                except (ConnectionError, TimeoutError, OSError, protocol.ProtocolError):
                    return
                protocol._close(fds)  # clients send none; never keep what we did not ask for
                try:
                    reply, out_fds = self.d.handle(msg, pid)
                except Exception as e:
                    reply, out_fds = {"ok": False, "error": "internal", "message": f"{type(e).__name__}: {e}"}, []
                try:
                    protocol.send(conn, reply, out_fds, timeout=30.0)
                except (OSError, TimeoutError):
                    return

    def close(self):
        try:
            self.sock.close()
        finally:
            self.path.unlink(missing_ok=True)


def take_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = Path(path).read_text().strip() or "?"
        os.close(fd)
        raise RuntimeError(f"another weight-cache daemon (PID {holder}) already serves this device (lock {path})") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="restartkit-weightcache-daemon")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--device-uuid", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none")
    p.add_argument("--revision", default="")
    p.add_argument("--draft", action="store_true")
    p.add_argument("--socket-dir", default="")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    set_parent_death_signal()
    block_stop_signals()
    d = Daemon(args)
    sock_path = protocol.socket_path(args.device_uuid, args.draft, args.socket_dir, create=True)
    lock_path = sock_path.with_name(sock_path.name + ".lock")
    try:
        lock_fd = take_lock(lock_path)
    except RuntimeError as e:
        emit("error", message=str(e))
        return 3
    sock_path.unlink(missing_ok=True)  # a stale socket from a killed daemon: we hold the lock, so it is ours to replace
    server = _Server(d, sock_path)
    server.start()
    d.state = "loading"
    emit("loading", socket=str(sock_path))
    outcome: dict = {}

    def load():
        try:
            d.load()
            emit("ready", socket=str(sock_path), nbytes=d.arena.nbytes, tensors=len(d.arena.manifest), load_s=d.load_s)
        except Exception as e:
            outcome["error"] = f"{type(e).__name__}: {e}"

    threading.Thread(target=load, daemon=True).start()
    code = 0
    while True:
        if next_stop_signal(0.2) is not None:
            break
        if "error" in outcome:
            emit("error", message=outcome["error"])
            code = 1
            break
        if d.stop_event.is_set():
            break
    d.state = "stopping"
    server.close()
    d.release()
    os.close(lock_fd)
    lock_path.unlink(missing_ok=True)
    emit("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
