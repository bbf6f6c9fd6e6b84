"""`restartkit preload`: one launcher per node, one daemon per local device.

Local device i serves DP rank start + g // tp and TP rank g % tp, where
g = node_rank * local_devices + i.  Ready only when every local rank serves;
a rank that dies while starting stops the others and the launcher exits with
that rank's code; a startup timeout bounds the whole start; each daemon has a
parent-death signal.  Health (HTTP, loopback by default): loading, ready,
degraded (a rank died after ready), stopping.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from restartkit.errors import UsageError
from restartkit.process.seam import Seam
from restartkit.process.signals import block_stop_signals, next_stop_signal


@dataclass
class Layout:
    model: str
    device: str = "cpu"
    tp_size: int = 1
    dp_size: int = 1
    dp_start_rank: int = 0
    expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    weight_cache_master_port: int = 29650
    engine_master_port: int = 0
    dtype: str = "float32"
    quantization: str = "none"
    revision: str = ""
    socket_dir: str = ""
    draft_model: str = ""

    def check(self) -> None:
        world = self.tp_size * self.dp_size
        if world % self.nnodes:
            raise UsageError(f"TP {self.tp_size} x DP {self.dp_size} = {world} ranks do not split over {self.nnodes} nodes",
                             hint="use a world size divisible by --nnodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and self.engine_master_port and self.weight_cache_master_port == self.engine_master_port:
            raise UsageError(f"--weight-cache-master-port {self.weight_cache_master_port} is the engine's master port too",
                             hint="the weight cache's rendezvous needs a port of its own: pick another --weight-cache-master-port")

    def groups(self) -> list[tuple[str, bool]]:
        """(checkpoint, is the draft group): the model's daemons, then the draft model's."""
        return [(self.model, False)] + ([(self.draft_model, True)] if self.draft_model else [])

    def local_ranks(self) -> list[dict]:
        local = self.tp_size * self.dp_size // self.nnodes
        out = []
        for i in range(local):
            g = self.node_rank * local + i
            dp_rank, tp_rank = self.dp_start_rank + g // self.tp_size, g % self.tp_size
            device = f"cuda:{i}" if self.device == "cuda" else "cpu"
            out.append({"local": i, "global": dp_rank * self.tp_size + tp_rank, "dp_rank": dp_rank,
                        "tp_rank": tp_rank, "device": device})
        return out


def expected_uuids(layout: Layout) -> list[str]:
    from restartkit.weightcache.daemon import device_uuid
    return [device_uuid(r["device"], r["global"]) for r in layout.local_ranks()]


@dataclass
class Rank:
    spec: dict
    draft: bool
    proc: subprocess.Popen = None
    state: str = "starting"
    info: dict = field(default_factory=dict)
    returncode: int | None = None


class Launcher:
    def __init__(self, layout: Layout, startup_timeout_s: float = 600.0, health_host: str = "127.0.0.1",
                 health_port: int = 0, say=lambda m: print(m, flush=True)):
        layout.check()
        self.layout, self.timeout, self.say = layout, startup_timeout_s, say
        self.health_host, self.health_port = health_host, health_port
        self.ranks: list[Rank] = []
        self.state = "loading"
        self.store = None
        self._store_lock = threading.Lock()

    def spawn(self) -> None:
        uuids = expected_uuids(self.layout)
        for model, draft in self.layout.groups():
            for spec, uuid in zip(self.layout.local_ranks(), uuids):
                argv = [sys.executable, "-m", "restartkit.weightcache.daemon", "--model", model,
                        "--device", spec["device"], "--device-uuid", uuid,
                        "--tp-size", str(self.layout.tp_size), "--tp-rank", str(spec["tp_rank"]),
                        "--dp-size", str(self.layout.dp_size), "--dp-rank", str(spec["dp_rank"]),
                        "--dtype", self.layout.dtype, "--quantization", self.layout.quantization,
                        "--revision", self.layout.revision, "--socket-dir", self.layout.socket_dir]
                if self.layout.expert_parallel:
                    argv.append("--expert-parallel")
                if draft:
                    argv.append("--draft")
                env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ""}  # expandable segments cannot be shared over IPC
                r = Rank(spec=spec, draft=draft)
                r.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
                threading.Thread(target=self._read_events, args=(r,), daemon=True).start()
                self.ranks.append(r)

    def _read_events(self, r: Rank) -> None:
        for line in r.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            r.state = ev.get("event", r.state)
            r.info.update(ev)
            tag = f"rank {r.spec['global']}{' (draft)' if r.draft else ''} on {r.spec['device']}"
            if r.state == "ready":
                self.say(f"{tag}: ready ({ev['tensors']} tensors, {ev['nbytes'] / 1e9:.2f} GB, loaded in {ev['load_s']:.2f} s)")
            elif r.state == "error":
                self.say(f"{tag}: {ev.get('message')}")

    def wait_started(self) -> int:
        """0 when every rank is ready; else the failing rank's exit code (all others stopped)."""
        failed: list = []

        def settled() -> bool:
            failed[:] = [r for r in self.ranks if r.proc.poll() is not None][:1]
            return bool(failed) or all(r.state == "ready" for r in self.ranks)
        seam = Seam()
        if seam.wait_until(settled, self.timeout):
            if failed:
                r = failed[0]
                rc = r.proc.poll()
                seam.sleep(0.1)  # let the reader thread take the last event
                self.say(f"rank {r.spec['global']} exited with code {rc} while starting ({r.info.get('message', 'no message')}); stopping the others")
                self.stop_all()
                return rc or 1
            self.state = "ready"
            self._rendezvous()
            return 0
        states = ", ".join(f"rank {r.spec['global']}: {r.state}" for r in self.ranks)
        self.say(f"not every rank was ready within {self.timeout:.0f} s ({states}); stopping all")
        self.stop_all()
        return 124

    def _rendezvous(self) -> None:
        if self.layout.nnodes == 1:
            return
        from datetime import timedelta

        from torch.distributed import TCPStore
        lay = self.layout
        self.store = TCPStore(lay.master_addr, lay.weight_cache_master_port, lay.nnodes, lay.node_rank == 0,
                              timeout=timedelta(seconds=self.timeout))
        self._heartbeat()

    # Each node's launcher writes alive/<node> = its clock every second while its ranks serve, and
    # deletes it when it stops; a node whose stamp is older than NODE_STALE_S is not ready.
    NODE_STALE_S = 5.0

    def _heartbeat(self) -> None:
        with self._store_lock:
            self.store.set(f"alive/{self.layout.node_rank}", repr(time.time()))

    def node_states(self) -> dict[int, str] | None:
        if self.store is None:
            return None
        out = {}
        try:
            with self._store_lock:
                for n in range(self.layout.nnodes):
                    key = f"alive/{n}"
                    if not self.store.check([key]):
                        out[n] = "gone"
                        continue
                    age = time.time() - float(self.store.get(key).decode())
                    out[n] = "ready" if age < self.NODE_STALE_S else f"silent for {age:.0f} s"
        except Exception as e:  # node 0 holds the store: without it nobody knows
            return {n: f"unknown ({type(e).__name__}: the store on node 0 does not answer)" for n in range(self.layout.nnodes)}
        return out

    def cluster_ready(self) -> bool | None:
        states = self.node_states()
        return None if states is None else all(v == "ready" for v in states.values())

    def monitor(self, stop: threading.Event) -> None:
        beat = 0.0
        while not stop.wait(0.2):
            if self.store is not None and self.state == "ready" and time.monotonic() - beat >= 1.0:
                try:
                    self._heartbeat()
                except Exception:
                    pass
                beat = time.monotonic()
            if self.state == "ready" and any(r.proc.poll() is not None for r in self.ranks):
                dead = [r.spec["global"] for r in self.ranks if r.proc.poll() is not None]
                self.state = "degraded"
                self.say(f"degraded: rank(s) {dead} exited; the others keep serving")

    def stop_all(self, timeout: float = 10.0) -> None:
        self.state = "stopping"
        if self.store is not None:
            try:
                with self._store_lock:
                    self.store.delete_key(f"alive/{self.layout.node_rank}")
            except Exception:
                pass
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for r in self.ranks:
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()

    def health(self) -> dict:
        nodes = self.node_states()
        return {"state": self.state, "cluster_ready": None if nodes is None else all(v == "ready" for v in nodes.values()),
                "nodes": nodes,
                "ranks": [{"rank": r.spec["global"], "tp_rank": r.spec["tp_rank"], "dp_rank": r.spec["dp_rank"],
                           "device": r.spec["device"], "draft": r.draft, "state": r.state,
                           "alive": r.proc.poll() is None, "pid": r.proc.pid} for r in self.ranks]}

    def serve_health(self) -> ThreadingHTTPServer | None:
        if not self.health_port:
            return None
        launcher = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                body = json.dumps(launcher.health()).encode()
                self.send_response(200 if launcher.state == "ready" else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        srv = ThreadingHTTPServer((self.health_host, self.health_port), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv


def run(launcher: Launcher) -> int:
    """Foreground: start, report, serve until SIGTERM/SIGINT."""
    block_stop_signals()
    launcher.spawn()
    health = launcher.serve_health()
    rc = launcher.wait_started()
    if rc:
        return rc
    launcher.say(f"weight cache ready: {len(launcher.ranks)} rank(s) on this node")
    stop = threading.Event()
    threading.Thread(target=launcher.monitor, args=(stop,), daemon=True).start()
    while next_stop_signal(0.5) is None:
        if launcher.ranks and all(r.proc.poll() is not None for r in launcher.ranks):
            launcher.say("every rank has exited; the launcher stops")
            break
    stop.set()
    launcher.stop_all()
    if health:
        health.shutdown()
    launcher.say("weight cache stopped")
    return 0
