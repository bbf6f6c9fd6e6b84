"""From checkpoint to processed weights: slice for this rank, cast, quantize.

The same code runs in a cold start (the engine reads and processes the
checkpoint itself) and in the weight-cache daemon (which does it once and
hands the result over), so "processed weights" means work an ipc restart
really skips.  Quantization `int8`: weight-only, symmetric, one scale per
output channel, for every projection inside the decoder layers.
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


def processed_weights(model_dir: str, cfg: ModelConfig, par: Parallel, dtype: torch.dtype, quantization: str,
                      device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of this rank's processed weights, in checkpoint order."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; choose one of {QUANTIZATIONS}")
    for name, t in iter_checkpoint(model_dir, device=device):
        t = shard_tensor(name, t, cfg, par)
        if t is None:
            continue
        if quantization == "int8" and quantized(name):
            q, scale = quantize_int8(t)
            yield name, q
            yield name + SCALE_SUFFIX, scale.to(dtype)
        else:
            yield name, t.to(dtype)
