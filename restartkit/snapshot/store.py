"""Snapshot images on disk: one 0700 directory per snapshot with its CRIU
images and manifest.json, and a `current` symlink switched atomically.

A snapshot is complete only once its manifest exists; directories without
one are leftovers of an interrupted create and are pruned.  A failed restore
never deletes a snapshot: it marks it suspect.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from restartkit.guard.trust import trust_problem
from restartkit.files import write_json_atomic

MANIFEST = "manifest.json"


@dataclass
class Snapshot:
    path: Path
    manifest: dict
    damaged: str | None = None  # why the manifest cannot be used (kept for inspection, never restored)

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def suspect(self) -> dict | None:
        """Why it is not to be restored before a refresh (None: it may be): marked so after a failed restore or
        test, or dated in the future (a clock stepped back, an edited manifest), which no age can be read from."""
        if marked := self.manifest.get("suspect"):
            return marked
        ahead = self.manifest.get("created_at", 0) - time.time()
        if isinstance(ahead, (int, float)) and ahead > CLOCK_SKEW_S:
            return {"reason": f"it is dated {ahead:.0f} s in the future (a clock stepped back, or an edited "
                              "manifest)", "at": time.time()}
        return None

    @property
    def age_s(self) -> float:
        """Seconds since it was taken (0 for one dated in the future: `suspect` says so, and a refresh takes
        it again)."""
        return max(0.0, time.time() - self.manifest.get("created_at", 0))


CLOCK_SKEW_S = 300.0
MANIFEST_TYPES = {"created_at": (int, float), "pid": int, "tree_pids": list, "identity": dict, "canary": dict}
MANIFEST_OPTIONAL = {"kind": str, "files": dict, "suspect": dict, "phases": dict, "image_bytes": int,
                     "weight_cache": list, "tested": dict, "gpu": bool, "service": str}


def manifest_problem(m) -> str | None:
    """Why a manifest is not one restartkit wrote (None: it is one).  Every field the restore and the
    plan read is checked for its type, so that none of them has to."""
    if not isinstance(m, dict):
        return f"the manifest is a {type(m).__name__}, not an object"
    for key, kind in MANIFEST_TYPES.items():
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            return f"the manifest's {key} is missing or not a {getattr(kind, '__name__', 'number')}"
    for key, kind in MANIFEST_OPTIONAL.items():
        if m.get(key) is not None and not isinstance(m[key], kind):
            return f"the manifest's {key} is not a {kind.__name__}"
    if not math.isfinite(m["created_at"]):
        return "the manifest's created_at is not a time"
    if not m["tree_pids"] or not all(isinstance(p, int) and not isinstance(p, bool) and p > 1 for p in m["tree_pids"]):
        return "the manifest's tree_pids are not process ids"
    if m.get("kind") not in (None, "full", "weightless"):
        return f"the manifest's kind {m['kind']!r} is not full or weightless"
    return None


def load_snapshot(d: Path) -> Snapshot:
    """The snapshot in `d`, with `damaged` saying why it cannot be used when it cannot."""
    if d.is_symlink():
        return Snapshot(d, {}, f"{d} is a symbolic link: snapshots are directories of their own")
    try:
        manifest = json.loads((d / MANIFEST).read_text(), parse_constant=lambda c: math.nan)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        return Snapshot(d, {}, f"its manifest cannot be read ({getattr(e, 'strerror', None) or type(e).__name__})")
    if problem := manifest_problem(manifest):
        return Snapshot(d, manifest if isinstance(manifest, dict) else {}, problem)
    return Snapshot(d, manifest)


class SnapshotStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def trust_problem(self) -> str | None:
        """Why this root's snapshots must not be used (another user's directory, a link), or None."""
        return trust_problem(self.root, "snapshot images dir")

    def ensure(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        return self.root

    def new_dir(self) -> Path:
        self.ensure()
        sid = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        path = self.root / sid
        path.mkdir(mode=0o700)
        return path

    def list(self) -> list[Snapshot]:
        """Every snapshot, damaged ones too (`damaged` says why; they are kept for inspection)."""
        if not self.root.is_dir() or self.trust_problem():  # another user's root chooses nothing we restore
            return []
        return [load_snapshot(d) for d in sorted(self.root.iterdir())
                if (d.is_dir() or d.is_symlink()) and d.name != "current" and (d / MANIFEST).exists()]

    def get(self, sid: str) -> Snapshot | None:
        d = self.root / sid
        if self.trust_problem() or "/" in sid or sid in ("", ".", "..") or not (d / MANIFEST).exists():
            return None
        return load_snapshot(d)

    def current(self) -> Snapshot | None:
        link = self.root / "current"
        if not link.is_symlink():
            return None
        return self.get(os.readlink(link))

    def commit(self, path: Path, manifest: dict, make_current: bool = True) -> Snapshot:
        """Write the manifest, then (unless told not to) point `current` at it (both atomic)."""
        write_json_atomic(path / MANIFEST, manifest)
        snap = Snapshot(path, manifest)
        if make_current:
            self.make_current(snap)
        return snap

    def make_current(self, snap: Snapshot) -> None:
        tmp = self.root / f".current.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(snap.path.name, tmp)
        os.replace(tmp, self.root / "current")

    def mark_suspect(self, snap: Snapshot, reason: str) -> None:
        snap.manifest["suspect"] = {"reason": reason, "at": time.time()}
        self.save(snap)

    def clear_suspect(self, snap: Snapshot) -> None:
        if snap.manifest.pop("suspect", None) is not None:
            snap.manifest["suspect_cleared"] = {"at": time.time()}
            self.save(snap)

    def save(self, snap: Snapshot) -> None:
        """Write back a snapshot's manifest after a change to it (atomic)."""
        write_json_atomic(snap.path / MANIFEST, snap.manifest)

    def prune(self, keep: int) -> list[str]:
        """Keep the newest `keep` complete snapshots and `current`; drop the rest and any leftovers."""
        current = self.current()
        snaps = self.list()
        complete = [s for s in snaps if not s.damaged]
        # damaged ones are kept for inspection (`snapshot list` names them; removing them is the operator's call)
        keep_ids = {s.id for s in complete[-keep:]} | ({current.id} if current else set()) | \
            {s.id for s in snaps if s.damaged}
        removed = []
        for d in self.root.iterdir() if self.root.is_dir() else []:
            if d.is_symlink() or not d.is_dir() or d.name in keep_ids:
                continue
            if not (d / MANIFEST).exists() and time.time() - d.stat().st_mtime < 3600 and _owner_alive(d.name):
                continue  # a create in progress right now
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
        return removed


def _owner_alive(sid: str) -> bool:
    try:
        return os.path.exists(f"/proc/{int(sid.rsplit('-', 1)[1])}")
    except (ValueError, IndexError):
        return False


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
