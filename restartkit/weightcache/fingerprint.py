"""What a cached copy of the weights is, so a stale daemon cannot hand an
engine the wrong weights.

checkpoint = sha256 over, for every shard in order: its file name, its raw
safetensors header (names, dtypes, shapes, offsets) and the sha256 of its
whole contents.  Header-only hashes let two fine-tunes with the same layout
collide; the content digest does not.  Content digests are cached by (path,
size, mtime, inode, ctime) in the user's cache directory, so the cost is paid once
per checkpoint file.  The device UUID is checked on its own, not here.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path

from restartkit import __version__
from restartkit.reference.model.layout import shard_files

FIELDS = ("checkpoint", "architecture", "tp_size", "tp_rank", "dp_size", "dp_rank", "expert_parallel",
          "dtype", "quantization", "revision", "engine", "engine_version", "draft", "layout")

# the layout of a cache that holds the checkpoint's tensors as stored (for an engine that shards and
# processes them itself, such as vLLM), in place of the reference engine's processed per-rank layout
CHECKPOINT = "checkpoint"
# the reference engine's processed layout (restartkit.reference.model.weights): a cache built by a
# restartkit whose layout differs is refused by name, the engine loads from disk
REFERENCE_LAYOUT = "fused qkv_proj, gate_up_proj"

_CACHE = Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "restartkit" / "digests.json"


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 1024 * 1024:
            raise ValueError(f"{path}: safetensors header of {n} bytes is not plausible")
        return f.read(n)


def content_digest(path: Path, cache: dict | None = None) -> str:
    st = path.stat()
    # ctime too: a copy over the file in place with its mtime kept (`cp -p`, `rsync --inplace -t`)
    # keeps size, mtime and inode, but no user-space call can set ctime back
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"
    if cache is not None and key in cache:
        return cache[key]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if cache is not None:
        cache[key] = digest
    return digest


def checkpoint_digest(model_dir: str | os.PathLike) -> tuple[str, dict]:
    """(digest, timing info).  Uses and updates the per-user digest cache."""
    t0 = time.perf_counter()
    try:
        cache = json.loads(_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    before = len(cache)
    h = hashlib.sha256()
    files = shard_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no safetensors files")
    nbytes = 0
    for path in files:
        h.update(path.name.encode() + b"\0")
        h.update(_header(path))
        h.update(content_digest(path, cache).encode())
        nbytes += path.stat().st_size
    if len(cache) != before:
        try:
            _CACHE.parent.mkdir(parents=True, exist_ok=True)
            tmp = _CACHE.with_name(f".digests.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, _CACHE)
        except OSError:
            pass
    return h.hexdigest(), {"seconds": round(time.perf_counter() - t0, 4), "bytes": nbytes,
                           "cached": len(cache) == before}


def fingerprint(model_dir: str, *, tp_size: int = 1, tp_rank: int = 0, dp_size: int = 1, dp_rank: int = 0,
                expert_parallel: bool = False, dtype: str, quantization: str = "none", revision: str = "",
                draft: bool = False, checkpoint: str | None = None) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {
        "checkpoint": checkpoint or checkpoint_digest(model_dir)[0],
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "tp_size": tp_size, "tp_rank": tp_rank, "dp_size": dp_size, "dp_rank": dp_rank,
        "expert_parallel": expert_parallel, "dtype": dtype, "quantization": quantization,
        "revision": revision, "engine": CHECKPOINT if dtype == CHECKPOINT else "reference",
        "engine_version": __version__, "draft": draft,
        "layout": CHECKPOINT if dtype == CHECKPOINT else REFERENCE_LAYOUT,
    }


def differences(daemon: dict, engine: dict) -> list[dict]:
    """Each differing field with both values."""
    return [{"field": k, "daemon": daemon.get(k), "engine": engine.get(k)}
            for k in FIELDS if daemon.get(k) != engine.get(k)]


def describe(diffs: list[dict]) -> str:
    return "; ".join(f"{d['field']} differs (daemon {d['daemon']!r}, engine {d['engine']!r})" for d in diffs)


def local_checkpoint_identity(model: str) -> str | None:
    """A local checkpoint directory: its content digest; a single file (a GGUF, say): its size and
    modification time (hashing many GB at every plan would cost more than it tells); a hub id: None."""
    if os.path.isdir(model):
        return checkpoint_digest(model)[0]
    if os.path.isfile(model):
        st = os.stat(model)
        return f"file size {st.st_size} mtime_ns {st.st_mtime_ns}"
    return None
