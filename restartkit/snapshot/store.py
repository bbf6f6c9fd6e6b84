"""Snapshot images on disk: one 0700 directory per snapshot with its CRIU
images and manifest.json, and a `current` symlink switched atomically.

A snapshot is complete only once its manifest exists; directories without
one are leftovers of an interrupted create and are pruned.  A failed restore
never deletes a snapshot: it marks it suspect.
"""
from __future__ import annotations

import json
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

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def suspect(self) -> dict | None:
        return self.manifest.get("suspect")

    @property
    def age_s(self) -> float:
        return time.time() - self.manifest.get("created_at", 0)


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
        if not self.root.is_dir() or self.trust_problem():  # another user's root chooses nothing we restore
            return []
        out = []
        for d in sorted(self.root.iterdir()):
            if d.is_dir() and not d.is_symlink() and (d / MANIFEST).exists():
                try:
                    out.append(Snapshot(d, json.loads((d / MANIFEST).read_text())))
                except ValueError:
                    continue
        return out

    def get(self, sid: str) -> Snapshot | None:
        d = self.root / sid
        if self.trust_problem() or d.is_symlink():
            return None
        try:
            return Snapshot(d, json.loads((d / MANIFEST).read_text()))
        except (OSError, ValueError):
            return None

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
        complete = self.list()
        keep_ids = {s.id for s in complete[-keep:]} | ({current.id} if current else set())
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
