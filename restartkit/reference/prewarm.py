"""First-use costs of a forward pass, paid on small stand-in tensors.

A process's first matmul, first attention and first of each elementwise
kernel load libraries and kernel modules; none of that depends on the
weights.  Running the same kinds of operation once, on tensors with the
model's inner shapes but a batch of a few tokens, pays those costs before the
weights arrive (or beside their attach)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.inference_mode()
def prewarm_kernels(cfg, device: torch.device, dtype: torch.dtype, tp_size: int = 1) -> None:
    h, hd = cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads // tp_size, max(1, cfg.num_key_value_heads // tp_size)
    inter = cfg.intermediate_size // tp_size
    x = torch.randn(4, h, device=device, dtype=dtype)
    for out_features, in_features in ((nh * hd, h), (nkv * hd, h), (h, nh * hd), (inter, h), (h, inter)):
        w = torch.randn(out_features, in_features, device=device, dtype=dtype)
        y = F.linear(x if in_features == h else torch.randn(4, in_features, device=device, dtype=dtype), w)
        F.linear(y[:1], w) if out_features == in_features else None
    var = x.float().pow(2).mean(-1, keepdim=True)
    x = (x.float() * torch.rsqrt(var + 1e-5)).to(dtype)
    q = torch.randn(1, nh, 4, hd, device=device, dtype=dtype)
    k = torch.randn(1, nh, 16, hd, device=device, dtype=dtype)
    mask = torch.arange(16, device=device).unsqueeze(0) <= torch.arange(4, device=device).unsqueeze(1)
    F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    F.scaled_dot_product_attention(q[:, :, :1], k, k, attn_mask=mask[:1])
    torch.cat((-q[..., hd // 2:], q[..., : hd // 2]), dim=-1) * q
    F.silu(y) * y
    logits = torch.randn(4, 1024, device=device, dtype=dtype).float()
    int(torch.argmax(logits[-1].cpu()))
    torch.cuda.synchronize(device)
