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
def _rope_write_kv(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, rows_ptr, table_ptr, ck_ptr, cv_ptr, q_out,
                   n_heads, n_kv, q_row, kv_row, cols, row_stride, head_stride,
                   HALF: tl.constexpr, BLOCK: tl.constexpr):
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
        block = tl.load(table_ptr + tl.load(rows_ptr + b) * cols + pos // BLOCK)
        at = (block // cols) * row_stride + j * head_stride + ((block % cols) * BLOCK + pos % BLOCK) * 2 * HALF
        tl.store(ck_ptr + at + lo, o1.to(dtype))
        tl.store(ck_ptr + at + HALF + lo, o2.to(dtype))
        vsrc = v_ptr + b * kv_row + j * 2 * HALF
        tl.store(cv_ptr + at + lo, tl.load(vsrc + lo))
        tl.store(cv_ptr + at + HALF + lo, tl.load(vsrc + HALF + lo))


def rope_write_kv(q, k, v, cos_table, sin_table, positions, rows, cache_k, cache_v, table):
    B, n_heads, hd = q.shape
    n_kv = k.shape[1]
    assert table.is_contiguous() and cache_k.shape[2] == table.shape[1] * ATTEND_CHUNK
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and cache_k.is_contiguous()
    assert cos_table.is_contiguous() and sin_table.is_contiguous() and cache_v.stride() == cache_k.stride()
    assert v.stride(0) == k.stride(0) and q.stride(1) == k.stride(1) == hd
    q_out = torch.empty(B, n_heads, hd, dtype=q.dtype, device=q.device)
    _rope_write_kv[(B, n_heads + n_kv)](q, k, v, cos_table, sin_table, positions, rows, table, cache_k, cache_v,
                                        q_out, n_heads, n_kv, q.stride(0), k.stride(0), table.shape[1],
                                        cache_k.stride(0), cache_k.stride(1), HALF=hd // 2, BLOCK=ATTEND_CHUNK,
                                        num_warps=1)
    return q_out


@triton.jit
def _silu_mul(gu_ptr, out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    dtype: tl.constexpr = out.dtype.element_ty
    g = tl.load(gu_ptr + row * 2 * n + offs, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n + n + offs, mask=keep, other=0.0).to(tl.float32)
    act = _round(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out + row * n + offs, (act * u).to(dtype), mask=keep)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.is_contiguous()
    B, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(B, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul[(B, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _attend_chunk(q_ptr, ck_ptr, cv_ptr, pos_ptr, rows_ptr, table_ptr, acc_ptr, ml_ptr, n_kv, n_chunks, q_row,
                  row_stride, head_stride, scale, idle, GROUP: tl.constexpr, QB: tl.constexpr,
                  HD: tl.constexpr, CHUNK: tl.constexpr, EXACT: tl.constexpr):
    """One chunk (a KV-cache block: table[row's slot, c]) of one row's keys for one KV head's query heads: the
    chunk's softmax numerator (acc), its largest score (m) and its sum (l), in float32; a chunk past the row's
    position writes m = -inf.  A row at position `idle` reads its first chunk only (as if at position CHUNK - 1).
    EXACT (float32 activations): the products in float32 on the CUDA cores; else (bfloat16, float16) on the tensor
    cores from the activations' dtype, summed in float32 (q, k and v are of that dtype already: each product is
    exact), the softmax numerator rounded to that dtype for its product with v, as torch's form rounds the
    probabilities.  On an H200, 63 rows of 600 positions at 8B shapes: 349 us a layer in float32 products, 67 us
    so (docs/BENCHMARKS.md)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    part = (b * n_kv + h) * n_chunks + c
    g = tl.arange(0, QB)
    d = tl.arange(0, HD)
    pos = tl.load(pos_ptr + b)
    pos = tl.where(pos == idle, CHUNK - 1, pos)
    start = c * CHUNK
    if start > pos:
        tl.store(ml_ptr + part * 2 * QB + g, tl.full([QB], float("-inf"), tl.float32))
        tl.store(ml_ptr + part * 2 * QB + QB + g, tl.zeros([QB], tl.float32))
    else:
        j = start + tl.arange(0, CHUNK)
        seen = j <= pos
        q = tl.load(q_ptr + b * q_row + (h * GROUP + g)[:, None] * HD + d[None, :], mask=(g < GROUP)[:, None],
                    other=0.0)
        block = tl.load(table_ptr + tl.load(rows_ptr + b) * n_chunks + c)  # the table's width is n_chunks
        base = (block // n_chunks) * row_stride + h * head_stride + (block % n_chunks) * CHUNK * HD
        o = tl.arange(0, CHUNK)
        k = tl.load(ck_ptr + base + o[:, None] * HD + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(cv_ptr + base + o[:, None] * HD + d[None, :], mask=seen[:, None], other=0.0)
        if EXACT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(seen[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)
        p = tl.exp(s - m[:, None])
        if EXACT:
            acc = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v)
        tl.store(acc_ptr + (part * QB + g)[:, None] * HD + d[None, :], acc)
        tl.store(ml_ptr + part * 2 * QB + g, m)
        tl.store(ml_ptr + part * 2 * QB + QB + g, tl.sum(p, axis=1))


@triton.jit
def _attend_reduce(acc_ptr, ml_ptr, pos_ptr, out_ptr, n_heads, n_kv, n_chunks, idle, GROUP: tl.constexpr,
                   QB: tl.constexpr, HD: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr):
    """One row's query head: its chunks combined (each scaled by exp(its max - the overall max))."""
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    h = hq // GROUP
    g = hq % GROUP
    pos = tl.load(pos_ptr + b)
    used = tl.where(pos == idle, 0, pos) // CHUNK + 1
    d = tl.arange(0, HD)
    first = (b * n_kv + h) * n_chunks
    big = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    out = tl.zeros([HD], tl.float32)
    for c0 in range(0, used, CB):
        c = c0 + tl.arange(0, CB)
        there = c < used
        m = tl.load(ml_ptr + (first + c) * 2 * QB + g, mask=there, other=float("-inf"))
        l = tl.load(ml_ptr + (first + c) * 2 * QB + QB + g, mask=there, other=0.0)
        acc = tl.load(acc_ptr + ((first + c) * QB + g)[:, None] * HD + d[None, :], mask=there[:, None], other=0.0)
        new_big = tl.maximum(big, tl.max(m, axis=0))
        w = tl.exp(m - new_big)
        rescale = tl.exp(big - new_big)
        total = total * rescale + tl.sum(l * w, axis=0)
        out = out * rescale + tl.sum(acc * w[:, None], axis=0)
        big = new_big
    tl.store(out_ptr + (b * n_heads + hq) * HD + d, (out / total).to(out_ptr.dtype.element_ty))


ATTEND_CHUNK = 64  # keys per program


def attend_decode(q, cache_k, cache_v, positions, rows, table):
    """Each row's query heads q [B, heads, hd] against the keys of slot rows[b] up to positions[b] (inclusive)
    in cache_k, cache_v [rows, kv_heads, cols*ATTEND_CHUNK, hd], chunk c in block table[rows[b], c] (block i at row
    i // cols, positions (i % cols)*ATTEND_CHUNK.. of it); returns
    [B, heads, hd].  Split over key chunks (a row's keys past its position are never read), then the chunks
    combined: two kernels.  A row at the spare position (the last the table addresses; nobody reads it) reads
    the first chunk only."""
    B, n_heads, hd = q.shape
    n_kv, n_chunks = cache_k.shape[1], table.shape[1]
    idle = n_chunks * ATTEND_CHUNK - 1
    assert q.is_contiguous() and cache_k.is_contiguous() and cache_v.stride() == cache_k.stride()
    assert table.is_contiguous() and cache_k.shape[2] == table.shape[1] * ATTEND_CHUNK
    group = n_heads // n_kv
    qb = max(16, triton.next_power_of_2(group))
    acc = torch.empty(B * n_kv * n_chunks * qb, hd, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * n_kv * n_chunks * 2 * qb, dtype=torch.float32, device=q.device)
    _attend_chunk[(B, n_kv, n_chunks)](q, cache_k, cache_v, positions, rows, table, acc, ml, n_kv, n_chunks,
                                       q.stride(0), cache_k.stride(0), cache_k.stride(1), hd ** -0.5, idle, GROUP=group, QB=qb, HD=hd,
                                       CHUNK=ATTEND_CHUNK, EXACT=q.dtype == torch.float32, num_warps=4)
    out = torch.empty_like(q)
    _attend_reduce[(B, n_heads)](acc, ml, positions, out, n_heads, n_kv, n_chunks, idle, GROUP=group, QB=qb, HD=hd,
                                 CHUNK=ATTEND_CHUNK, CB=16, num_warps=4)
    return out


@triton.jit
def _attend_tiles(q_ptr, ck_ptr, cv_ptr, pos_ptr, rows_ptr, table_ptr, tiles_ptr, out_ptr, n_kv, n_chunks, q_row,
                  row_stride, head_stride, scale, GROUP: tl.constexpr, GP: tl.constexpr, TILE: tl.constexpr,
                  HD: tl.constexpr, CHUNK: tl.constexpr, EXACT: tl.constexpr):
    """One tile (tiles[t]: first row, rows; up to TILE consecutive rows of one slot at consecutive positions) and
    one KV head: its query heads' attention over the slot's keys up to each row's position, block by block as the
    table lists them, the blocks combined as they come (a running max and sum in float32).  The products as
    _attend_chunk takes them (EXACT: float32 on the CUDA cores; else on the tensor cores, the softmax numerator
    rounded to the activations' dtype for its product with v).  A tile of no rows does nothing."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    r0 = tl.load(tiles_ptr + 2 * t)
    n = tl.load(tiles_ptr + 2 * t + 1)
    if n > 0:
        m = tl.arange(0, TILE * GP)  # (row in the tile, query head in the group)
        g = m % GP
        row = (r0 + m // GP).to(tl.int64)
        live = (m // GP < n) & (g < GROUP)
        d = tl.arange(0, HD)
        pos = tl.load(pos_ptr + row, mask=live, other=0)
        slot = tl.load(rows_ptr + r0)
        last = tl.load(pos_ptr + r0 + n - 1)
        q = tl.load(q_ptr + row[:, None] * q_row + (h * GROUP + g)[:, None] * HD + d[None, :], mask=live[:, None],
                    other=0.0)
        if EXACT:
            q = q.to(tl.float32)
        big = tl.full([TILE * GP], float("-inf"), tl.float32)
        total = tl.zeros([TILE * GP], tl.float32)
        acc = tl.zeros([TILE * GP, HD], tl.float32)
        o = tl.arange(0, CHUNK)
        for c in range(0, last // CHUNK + 1):
            block = tl.load(table_ptr + slot * n_chunks + c).to(tl.int64)
            base = (block // n_chunks) * row_stride + h * head_stride + (block % n_chunks) * CHUNK * HD
            k = tl.load(ck_ptr + base + o[:, None] * HD + d[None, :])
            v = tl.load(cv_ptr + base + o[:, None] * HD + d[None, :])
            if EXACT:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where((c * CHUNK + o)[None, :] <= pos[:, None], s, float("-inf"))
            new_big = tl.maximum(big, tl.max(s, axis=1))  # finite: every row sees key 0 in the first block
            p = tl.exp(s - new_big[:, None])
            rescale = tl.exp(big - new_big)
            total = total * rescale + tl.sum(p, axis=1)
            if EXACT:
                acc = acc * rescale[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            big = new_big
        out = acc / total[:, None]
        tl.store(out_ptr + row[:, None] * q_row + (h * GROUP + g)[:, None] * HD + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def attend_tiles(q, cache_k, cache_v, positions, rows, table, tiles, out, tile):
    """Prompt chunks' rows of q [T, heads, hd] (each row at positions[r] of slot rows[r]; its key and value written)
    against their slots' keys up to each row's position in cache_k, cache_v (as attend_decode reads them), into
    out [T, heads, hd]: one launch for every chunk of a step.  tiles int64 [N, 2]: (first row, rows) of up to
    `tile` consecutive rows of one slot at consecutive positions (kernels.chunk_tiles); rows no tile lists are left
    as they are; a tile of 0 rows does nothing (a graph's spare tiles).  Each row's result is the same whichever
    tile, step or batch it comes in: its keys are taken block by block in position order."""
    n_heads, hd = q.shape[1], q.shape[2]
    n_kv, n_chunks = cache_k.shape[1], table.shape[1]
    assert q.is_contiguous() and out.is_contiguous() and out.stride() == q.stride()
    assert cache_k.is_contiguous() and cache_v.stride() == cache_k.stride() and table.is_contiguous()
    group = n_heads // n_kv
    _attend_tiles[(tiles.shape[0], n_kv)](q, cache_k, cache_v, positions, rows, table, tiles, out, n_kv, n_chunks,
                                          q.stride(0), cache_k.stride(0), cache_k.stride(1), hd ** -0.5, GROUP=group,
                                          GP=triton.next_power_of_2(group), TILE=tile, HD=hd,
                                          CHUNK=ATTEND_CHUNK, EXACT=q.dtype == torch.float32, num_warps=4)
    return out


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count (1 included): one order of sums
def _linear_rows(x_ptr, w_ptr, out_ptr, M, N, K, w_row, k_span, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PARTS: tl.constexpr):
    """A tile of BM rows and BN columns of x [M, K] @ w[N, K].T over the K-range `k_span` long that program_id(2)
    takes: the products summed in float32, BK at a time, in order.  PARTS 1: the result in out's dtype; else a
    float32 part of its own ([PARTS, M, N]), summed by _sum_parts."""
    rm = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    k_lo = tl.program_id(2) * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        kk = k + tl.arange(0, BK)
        a = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * w_row + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < k_hi), other=0.0)
        acc = tl.dot(a, b, acc)
    keep = (rm[:, None] < M) & (rn[None, :] < N)
    if PARTS == 1:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        tl.store(out_ptr + (tl.program_id(2) * M + rm[:, None]) * N + rn[None, :], acc, mask=keep)


@triton.jit
def _sum_parts(parts_ptr, out_ptr, size, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < size
    acc = tl.load(parts_ptr + offs, mask=keep, other=0.0)
    for s in tl.static_range(1, PARTS):
        acc += tl.load(parts_ptr + s * size + offs, mask=keep, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=keep)


LINEAR_BM = 64  # rows a program of linear_rows takes, whatever the row count


def linear_config(k: int) -> dict:
    """The tiles linear_rows uses for a weight of k columns: a function of the weight's shape only, never of the row
    count (a row's sum order is the tiles' order).  The K range is not cut in parts (PARTS 1): on an H100 at
    Llama-3-8B's shapes, cutting it in 4 or 8 parts (each summed in its own program, then added in order) made a
    step's products take 12.1 ms instead of 8.1 at 1-64 rows (scripts/gpu_product_rows_probe.py,
    docs/BENCHMARKS.md)."""
    return {"BN": 64, "BK": 128 if k % 128 == 0 else 64, "PARTS": 1, "num_warps": 4, "num_stages": 4}


def linear_rows(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in x's dtype, each row's products summed in float32 in an order that does not
    depend on M (cuBLAS picks its kernel, and so its order, by the whole shape: in bf16 a row's result then depends
    on how many rows come with it, docs/BENCHMARKS.md)."""
    M, K = x.shape
    N = weight.shape[0]
    assert x.is_contiguous() and weight.shape[1] == K
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    c = dict(config or linear_config(K))
    parts = c.pop("PARTS")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    k_span = triton.cdiv(K, parts)
    grid = (triton.cdiv(N, c["BN"]), triton.cdiv(M, LINEAR_BM), parts)
    if parts == 1:
        _linear_rows[grid](x, weight, out, M, N, K, weight.stride(0), k_span, BM=LINEAR_BM, PARTS=1, **c)
        return out
    summed = torch.empty(parts, M, N, dtype=torch.float32, device=x.device)
    _linear_rows[grid](x, weight, summed, M, N, K, weight.stride(0), k_span, BM=LINEAR_BM, PARTS=parts, **c)
    block = 1024
    _sum_parts[(triton.cdiv(M * N, block),)](summed, out, M * N, PARTS=parts, BLOCK=block, num_warps=4)
    return out
