"""A snapshot's manifest sealed to its images: what the restore trusts the manifest for (the host
identity, the engine's argv and version, the weights, the PIDs, the kind) is bound to a digest of
the images at creation, so that an edited field, or images swapped under a manifest, are refused
naming the field before anything is restored.

The images' digest covers every image file's name and size, the whole of every one up to 4 MiB (CRIU's
process tree, cores, descriptors, memory maps), and the first and last MiB of larger ones (the pages):
milliseconds at a restore, whatever the size.  Without a key it is tamper-evident, not tamper-proof:
anyone who may write the images may write a new seal too (restartkit.guard.trust keeps that to this
user and root)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

SEALED = ("identity", "kind", "pid", "tree_pids", "weight_cache", "canary", "service", "gpu")
WHOLE_BYTES = 4 << 20
EDGE_BYTES = 1 << 20
SEALED_DIRS = ("shm",)  # the /dev/shm files saved with the images (restartkit.snapshot.criu)


def _sealed_files(images: Path) -> list[Path]:
    """CRIU's images (*.img) and the saved shared-memory files: not the logs, stats and PID files that
    restores and test restores write beside them."""
    files = [p for p in images.glob("*.img")]
    for d in SEALED_DIRS:
        files += [p for p in (images / d).rglob("*")] if (images / d).is_dir() else []
    return sorted(p for p in files if p.is_file() and not p.is_symlink())


def images_digest(images: Path) -> str:
    h = hashlib.sha256()
    for p in _sealed_files(images):
        size = p.stat().st_size
        h.update(f"{p.relative_to(images)}\0{size}\0".encode())
        with open(p, "rb") as f:
            if size <= WHOLE_BYTES:
                h.update(f.read())
            else:
                h.update(f.read(EDGE_BYTES))
                f.seek(size - EDGE_BYTES)
                h.update(f.read(EDGE_BYTES))
    return h.hexdigest()


def _fields(manifest: dict) -> dict[str, object]:
    """Each sealed value by its name; the identity key by key (a refusal names `identity.argv`)."""
    out = {}
    for key in SEALED:
        value = manifest.get(key)
        if key == "identity" and isinstance(value, dict):
            out.update({f"identity.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _digest(name: str, value, images: str) -> str:
    return hashlib.sha256(json.dumps([name, value, images], sort_keys=True, default=str).encode()).hexdigest()[:32]


def seal(manifest: dict, images: Path) -> dict:
    digest = images_digest(images)
    return {"images": digest, "fields": {n: _digest(n, v, digest) for n, v in _fields(manifest).items()}}


def seal_problem(manifest: dict, images: Path) -> str | None:
    """Why the manifest no longer matches what was sealed with its images (None: it does)."""
    sealed = manifest.get("seal")
    if not isinstance(sealed, dict) or not isinstance(sealed.get("fields"), dict):
        return "it has no seal (taken by restartkit before 0.3.0, or the seal was removed): take a new one"
    digest = images_digest(images)
    if digest != sealed.get("images"):
        return "its images are not the ones its manifest was sealed with (changed or swapped since it was taken)"
    now = _fields(manifest)
    for name in sorted(set(now) | set(sealed["fields"])):
        if name not in sealed["fields"] or _digest(name, now.get(name), digest) != sealed["fields"][name]:
            return f"its manifest's {name} was changed after the snapshot was taken"
    return None
