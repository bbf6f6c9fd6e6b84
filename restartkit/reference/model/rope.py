"""Rotary position embeddings: the inverse frequencies of each rope type, as transformers computes them, and the
cos and sin tables of every position the KV cache holds."""
from __future__ import annotations

import math

import torch

from restartkit.reference.model.config import UnsupportedConfig


def inv_frequencies(head_dim: int, theta: float, rope: dict | None = None) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies [head_dim/2] in float32 and the factor on cos and sin, as
    transformers computes them for each rope type (ModelConfig.rope)."""
    rope = rope or {}
    kind = rope.get("rope_type", "default")
    dims = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (theta ** dims)
    if kind in ("default", "dynamic"):
        return inv, 1.0
    factor = rope["factor"]
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        old = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        scaling = rope.get("attention_factor")
        if scaling is None:
            m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
            scaling = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
        fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
        orig = rope["original_max_position_embeddings"]

        def correction_dim(rotations):
            return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = correction_dim(fast), correction_dim(slow)
        if rope.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        pos = theta ** dims
        return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate, float(scaling)
    raise UnsupportedConfig(f"rope_type {kind!r} is not implemented")


def rope_tables(head_dim: int, max_len: int, theta: float, dtype: torch.dtype,
                device, rope: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position, [max_len, head_dim] in `dtype`, computed on the host.
    The first half of sin is negated, so that rotating half of x needs no negation:
    (-x2) * s == x2 * (-s) exactly, the same values as the "rotate half" form."""
    inv_freq, scaling = inv_frequencies(head_dim, theta, rope)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    sin[:, : head_dim // 2].neg_()
    return cos.to(dtype).to(device), sin.to(dtype).to(device)
