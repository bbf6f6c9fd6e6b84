"""The Triton kernels behind restartkit.reference.model.kernels (imported only where Triton is installed).

Every kernel rounds to the activations' dtype where torch's elementwise operations round: after each
multiplication and addition (`_round`), so bf16 results equal torch's bit for bit except where the
RMSNorm's sum is taken in another order."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    return x.to(dtype).to(tl.float32)


@triton.jit
def _add_rms_norm(x_ptr, d_ptr, w_ptr, x_out, h_out, n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    dtype: tl.constexpr = h_out.dtype.element_ty
    x = tl.load(x_ptr + row * n + offs, mask=keep, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * n + offs, mask=keep, other=0.0).to(tl.float32)
        x = _round(x + d, dtype)
        tl.store(x_out + row * n + offs, x.to(dtype), mask=keep)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    tl.store(h_out + row * n + offs, (_round(x * rstd, dtype) * w).to(dtype), mask=keep)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    B, n = x.shape
    h = torch.empty_like(x)
    x_new = torch.empty_like(x) if delta is not None else x
    block = triton.next_power_of_2(n)
    _add_rms_norm[(B,)](x, delta if delta is not None else x, weight, x_new, h, n, eps,
                        HAS_DELTA=delta is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return x_new, h


@triton.jit
def _rotate_half(x1, x2, c1, c2, s1, s2, dtype: tl.constexpr):
    """x * cos + rotate_half(x) * sin in halves (sin's first half negated), rounding as torch does."""
    o1 = _round(_round(x1 * c1, dtype) + _round(x2 * s1, dtype), dtype)
    o2 = _round(_round(x2 * c2, dtype) + _round(x1 * s2, dtype), dtype)
    return o1, o2


@triton.jit
def _rope_write_kv(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, rows_ptr, ck_ptr, cv_ptr, q_out,
                   n_heads, n_kv, q_row, kv_row, slot_stride, head_stride,
                   HALF: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dtype: tl.constexpr = q_out.dtype.element_ty
    lo = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + b)
    c1 = tl.load(cos_ptr + pos * 2 * HALF + lo).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + lo).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * 2 * HALF + lo).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + lo).to(tl.float32)
    if h < n_heads:
        src = q_ptr + b * q_row + h * 2 * HALF
        o1, o2 = _rotate_half(tl.load(src + lo).to(tl.float32), tl.load(src + HALF + lo).to(tl.float32),
                              c1, c2, s1, s2, dtype)
        dst = q_out + (b * n_heads + h) * 2 * HALF
        tl.store(dst + lo, o1.to(dtype))
        tl.store(dst + HALF + lo, o2.to(dtype))
    else:
        j = h - n_heads
        src = k_ptr + b * kv_row + j * 2 * HALF
        o1, o2 = _rotate_half(tl.load(src + lo).to(tl.float32), tl.load(src + HALF + lo).to(tl.float32),
                              c1, c2, s1, s2, dtype)
        at = tl.load(rows_ptr + b) * slot_stride + j * head_stride + pos * 2 * HALF
        tl.store(ck_ptr + at + lo, o1.to(dtype))
        tl.store(ck_ptr + at + HALF + lo, o2.to(dtype))
        vsrc = v_ptr + b * kv_row + j * 2 * HALF
        tl.store(cv_ptr + at + lo, tl.load(vsrc + lo))
        tl.store(cv_ptr + at + HALF + lo, tl.load(vsrc + HALF + lo))


def rope_write_kv(q, k, v, cos_table, sin_table, positions, rows, cache_k, cache_v):
    B, n_heads, hd = q.shape
    n_kv = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and cache_k.is_contiguous()
    assert cos_table.is_contiguous() and sin_table.is_contiguous() and cache_v.stride() == cache_k.stride()
    q_out = torch.empty(B, n_heads, hd, dtype=q.dtype, device=q.device)
    _rope_write_kv[(B, n_heads + n_kv)](q, k, v, cos_table, sin_table, positions, rows, cache_k, cache_v, q_out,
                                        n_heads, n_kv, q.stride(0), k.stride(0), cache_k.stride(0),
                                        cache_k.stride(1), HALF=hd // 2, num_warps=1)
    return q_out


@triton.jit
def _silu_mul(g_ptr, u_ptr, out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    dtype: tl.constexpr = out.dtype.element_ty
    g = tl.load(g_ptr + row * n + offs, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * n + offs, mask=keep, other=0.0).to(tl.float32)
    act = _round(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out + row * n + offs, (act * u).to(dtype), mask=keep)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    B, n = gate.shape
    out = torch.empty_like(gate)
    block = 1024
    _silu_mul[(B, triton.cdiv(n, block))](gate, up, out, n, BLOCK=block, num_warps=4)
    return out
