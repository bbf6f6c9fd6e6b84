"""Torch-free checks of a checkpoint directory (the CLI's fast path uses them)."""
from __future__ import annotations

import json
from pathlib import Path

INDEX = "model.safetensors.index.json"


def shard_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, in index order."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    return sorted(model_dir.glob("*.safetensors"))


def model_dir_ok(path: str) -> str | None:
    """None when `path` looks like a checkpoint directory, else why not."""
    p = Path(path)
    if not p.is_dir():
        return f"model directory {path} does not exist (create one: restartkit model create --preset tiny --out {path})"
    if not (p / "config.json").exists():
        return f"{path} has no config.json: not a Hugging Face checkpoint directory"
    if not any(p.glob("*.safetensors")):
        return f"{path} has no *.safetensors files"
    if not (p / "tokenizer.json").exists():
        return f"{path} has no tokenizer.json (the reference engine reads a tokenizers-format tokenizer)"
    import os
    if unreadable := next((f for f in sorted(p.iterdir()) if f.is_file() and not os.access(f, os.R_OK)), None):
        # (safetensors would call it "No such file or directory")
        return (f"{unreadable} cannot be read by uid {os.geteuid()}: permission denied (make the checkpoint "
                f"readable by the engine's user: chmod -R a+rX {path})")
    import json
    from restartkit.reference.model.config import ModelConfig
    try:
        ModelConfig.from_hf(json.loads((p / "config.json").read_text()))
    except ValueError as e:  # UnsupportedConfig names the key; a broken JSON file says where
        return f"{path}: {e}"
    except (TypeError, KeyError) as e:
        return f"{path}/config.json is not a Llama config the reference engine can read: {type(e).__name__}: {e}"
    return None


def draft_problem(model: str, draft: str) -> str | None:
    """None when `draft` can serve as `model`'s draft model (same tokenizer), else why not."""
    import json
    if problem := model_dir_ok(draft):
        return f"draft_model: {problem}"
    mine, its = (json.loads((Path(d) / "config.json").read_text()) for d in (model, draft))
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        if mine.get(key) != its.get(key):
            return (f"the draft model's {key} is {its.get(key)}, the model's {mine.get(key)}: a draft model "
                    f"must share the model's tokenizer ({draft})")
    return None
