"""Small file helpers, one of each: a private directory, an atomic owner-only JSON write, the tail of a log."""
from __future__ import annotations

import json
import os
from pathlib import Path


def ensure_private_dir(path: Path) -> Path:
    """`path` made if needed, owner-only (0700) either way."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def write_json_atomic(path: Path, data, indent: int | None = 2) -> None:
    """Written beside `path` and renamed over it (a reader sees the old or the new file, never
    half of one); owner-only, since PID files, manifests and intents name the engine's argv."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as f:
        f.write(json.dumps(data, indent=indent))
    os.replace(tmp, path)


def log_tail(path: Path | None, lines: int = 15) -> str:
    """The last lines of a log (at most its last 8 KiB), "" when there is none."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
