"""Torch-free checks of a checkpoint directory (the CLI's fast path uses them)."""
from __future__ import annotations

from pathlib import Path


def model_dir_ok(path: str) -> str | None:
    """None when `path` looks like a checkpoint directory, else why not."""
    p = Path(path)
    if not p.is_dir():
        return f"model directory {path} does not exist (create one: restartkit model create --preset tiny --out {path})"
    if not (p / "config.json").exists():
        return f"{path} has no config.json: not a Hugging Face checkpoint directory"
    if not any(p.glob("*.safetensors")):
        return f"{path} has no *.safetensors files"
    return None
