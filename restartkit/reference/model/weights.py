"""From checkpoint to processed weights: slice for this rank, fuse, cast, quantize.

The same code runs in a cold start (the engine reads and processes the
checkpoint itself) and in the weight-cache daemon (which does it once and
hands the result over), so "processed weights" means work an ipc restart
really skips.  Fused: each layer's q, k and v projections are one tensor
(qkv_proj), gate and up one (gate_up_proj), rows in that order, so a decode
step runs two matrix products where it ran five.  Quantization `int8`:
weight-only, symmetric, one scale per output channel, for every projection
inside the decoder layers.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from restartkit.reference.model.checkpoint import iter_checkpoint
from restartkit.reference.model.llama import LlamaForCausalLM, ModelConfig, Parallel, shard_tensor

QUANTIZATIONS = ("none", "int8")
SCALE_SUFFIX = "_scale"
# a checkpoint's projection -> (the processed tensor it goes into, its place there); the parts of each
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
PARTS = {"qkv_proj": 3, "gate_up_proj": 2}


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T with q int8 [out, in] and scale [out, 1]."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1), requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.weight_scale.to(x.dtype))


def quantized(name: str) -> bool:
    return ".layers." in name and name.endswith("_proj.weight") or (".experts." in name and name.endswith(".weight"))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w32 = w.float()
    scale = w32.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    q = torch.round(w32 / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def build_model(cfg: ModelConfig, par: Parallel, dtype: torch.dtype, quantization: str) -> LlamaForCausalLM:
    """The model on the meta device, in its processed form (Int8Linear where quantized)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, par).to(dtype=dtype)
        if quantization == "int8":
            for name, mod in list(model.named_modules()):
                if isinstance(mod, nn.Linear) and quantized(name + ".weight"):
                    parent, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(parent), attr, Int8Linear(mod.in_features, mod.out_features))
    return model


def fused_into(name: str) -> tuple[str, int] | None:
    """The processed tensor a checkpoint tensor is part of, and its place: ("model.layers.3.self_attn.qkv_proj.weight",
    1) for "model.layers.3.self_attn.k_proj.weight"; None for a tensor kept as it is (experts are not fused)."""
    if ".layers." not in name or ".experts." in name:
        return None
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj not in FUSED:
        return None
    into, place = FUSED[proj]
    return f"{parent}.{into}.{leaf}", place


def processed_weights(model_dir: str, cfg: ModelConfig, par: Parallel, dtype: torch.dtype, quantization: str,
                      device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of this rank's processed weights, in checkpoint order (a fused tensor where its last
    part comes)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; choose one of {QUANTIZATIONS}")
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in iter_checkpoint(model_dir, device=device):
        t = shard_tensor(name, t, cfg, par)
        if t is None:
            continue
        if (part := fused_into(name)) is not None:
            parts = pending.setdefault(part[0], {})
            parts[part[1]] = t.to(dtype)
            if len(parts) < PARTS[part[0].split(".")[-2]]:
                continue
            name, t = part[0], torch.cat([parts[i] for i in sorted(parts)])
            del pending[name]
        yield from _processed(name, t, dtype, quantization)
    if pending:
        missing = next(iter(pending))
        raise ValueError(f"{model_dir}: the checkpoint lacks part of {missing} (it has {len(pending[missing])} "
                         "of its projections); is it complete?")


def _processed(name: str, t: torch.Tensor, dtype: torch.dtype, quantization: str):
    """One tensor cast (or quantized, with its scale after it)."""
    if quantization == "int8" and quantized(name):
        q, scale = quantize_int8(t)
        yield name, q
        yield name + SCALE_SUFFIX, scale.to(dtype)
    else:
        yield name, t.to(dtype)


def set_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the parameter `name` (no copy)."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    setattr(mod, attr, torch.nn.Parameter(tensor, requires_grad=False))
