"""The decode step's elementwise work, fused: three kernels a layer instead of about twenty-five.

One decode step of an 8B model on an H200 reads 16 GB of weights in about 3.8 ms; written as plain torch
operations it launched about 36 kernels a layer, 1 160 a step, and each small kernel costs a few
microseconds even inside a CUDA graph, so the step took 7-10 ms (docs/BENCHMARKS.md, issue 40).  Here:

  - add_rms_norm: the residual add and the next RMSNorm (x + delta, then the norm of that), one kernel;
  - rope_write_kv: rotary embedding of q and k, and k and v written into the KV cache, one kernel;
  - attend_decode: a decode step's attention, split over chunks of keys and combined, two kernels, reading
    only the keys up to each row's position (a graph's static shapes otherwise attend over the whole slot);
  - silu_mul: SwiGLU's silu(gate) * up, one kernel.

Each has a torch form, used on the CPU, where Triton is missing, and as the check of the kernels
(scripts/gpu_decode_variants.py compares them on a GPU).  The kernels round where torch's elementwise
operations round (to the activations' dtype after each operation), so they compute what the torch form
computes, up to the order of the RMSNorm's sum.  Triton compiles each kernel on its first use and keeps it
in its cache directory (~/.triton/cache): a restarted engine loads them from there.
"""
from __future__ import annotations

import functools
import os
import threading

import torch
import torch.nn.functional as F

BLOCK = 64  # positions a KV-cache block holds (restartkit.reference.model.paged)
NO_TRITON_ENV = "RESTARTKIT_NO_TRITON"  # set (to anything): the torch forms everywhere
CHUNK_KERNEL_ENV = "RESTARTKIT_CHUNK_KERNEL"  # "0": prompt chunks by torch's attention, one by one (chunks_fused)
ROWS_KERNEL_ENV = "RESTARTKIT_ROWS_KERNEL"  # "1": bf16/fp16 matrix products by linear_rows (rows_fused)


@functools.lru_cache(maxsize=1)
def _triton():
    """The compiled kernels, or None where Triton is not installed (or switched off)."""
    if os.environ.get(NO_TRITON_ENV):
        return None
    try:
        from restartkit.reference.model import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def load_in_background() -> threading.Thread:
    """Import Triton and the kernels in a thread (about 0.3 s of imports): a GPU engine starts it before its
    weights load, so the first forward pass finds them ready."""
    thread = threading.Thread(target=_triton, name="triton-import", daemon=True)
    thread.start()
    return thread


def fused(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like x (on a GPU, with Triton installed)."""
    return x.is_cuda and _triton() is not None


def chunks_fused(x: torch.Tensor) -> bool:
    """Whether a step's prompt chunks attend in one launch (attend_chunks) for tensors like x: where the kernels
    run, unless CHUNK_KERNEL_ENV is "0" (then each chunk by torch's attention, as before that kernel: on an H100 in
    bf16 the kernel and torch's attention round a prompt's rows differently, docs/BENCHMARKS.md)."""
    return fused(x) and os.environ.get(CHUNK_KERNEL_ENV, "1") != "0"


def rows_fused(x: torch.Tensor) -> bool:
    """Whether the matrix products of x (bf16 or fp16, where the kernels run) go through linear_rows, whose rows do
    not depend on how many come together: where ROWS_KERNEL_ENV is "1".  Otherwise cuBLAS's, which in bf16 round a
    row by the row count, so that a greedy answer depends on what runs beside it (docs/BENCHMARKS.md)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and fused(x)
            and os.environ.get(ROWS_KERNEL_ENV, "0") == "1")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) for x, delta [B, H]; delta None: (x, RMSNorm(x)).  The norm as
    Hugging Face's Llama computes it: in float32, back to x's dtype, times the weight."""
    if fused(x):
        return _triton().add_rms_norm(x, delta, weight, eps)
    if delta is not None:
        x = x + delta
    return x, weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, head_dim] with cos, sin [T, head_dim] (sin's first half negated)."""
    half = x.shape[-1] // 2
    return x * cos.unsqueeze(1) + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin.unsqueeze(1)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor,
                  sin_table: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: q [B, heads, hd], k and v [B, kv_heads, hd]; row b at
    positions[b] in slot rows[b] of cache_k, cache_v [rows, kv_heads, cols*BLOCK, hd], in the block
    table[rows[b], positions[b] // BLOCK] (restartkit.reference.model.paged: block i at row i // cols).
    Writes the rotated k and v there; returns the rotated q [B, heads, hd]."""
    if fused(q):
        return _triton().rope_write_kv(q, k, v, cos_table, sin_table, positions, rows, cache_k, cache_v, table)
    cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
    cols = table.shape[1]
    block = table[rows, positions // BLOCK]
    row, at = block // cols, (block % cols) * BLOCK + positions % BLOCK
    cache_k[row, :, at] = rotate(k, cos, sin)
    cache_v[row, :, at] = v
    return rotate(q, cos, sin)


def attend_decode(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                  rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """On a GPU with Triton: each row's query heads q [B, heads, hd] against the keys of slot rows[b] up to
    positions[b] in cache_k, cache_v [rows, kv_heads, cols*BLOCK, hd], block by block as table[rows[b]] lists
    them (a row's keys past its position are never read), the blocks combined in float32; [B, heads, hd].  A
    row at the spare position (the last the table addresses: a row nobody reads) attends to the first block
    only.  Elsewhere None: the caller's matrix products over a masked span (attend)."""
    if not fused(q):
        return None
    return _triton().attend_decode(q, cache_k, cache_v, positions, rows, table)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's query heads, q [B, n_kv, group, hd] (query head h reads KV head h // group), against its keys
    and values [B, n_kv, span, hd] (head-major: strided batches read in place, no copy of the cache); mask
    bool [B, span], True where a key is not seen.  Matrix products around a softmax in float32, as
    transformers computes it (the CPU; a GPU runs attend_decode)."""
    scores = torch.matmul(q, keys.transpose(2, 3)).float() * q.shape[-1] ** -0.5
    probs = scores.masked_fill(mask[:, None, None, :], float("-inf")).softmax(-1).to(q.dtype)
    return torch.matmul(probs, values)


def attend_slots(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, lo: int, n: int, rows: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """`attend` for decode rows whose keys are in their home rows among the n consecutive slots from `lo` of
    cache_k, cache_v [slots, kv_heads, positions, hd] (restartkit.reference.model.paged.covering): those slots read
    in place instead of the rows' keys copied.  Row b's query q [B, kv_heads, group, hd] goes to slot rows[b]; the
    other slots' queries are zero and attend to their first key only (so that no softmax is empty).  [B, kv_heads,
    group, hd]."""
    at = rows - lo
    span = mask.shape[-1]
    qs = q.new_zeros(n, *q.shape[1:]).index_copy_(0, at, q)
    masks = mask.new_ones(n, span)
    masks[:, 0] = False
    masks.index_copy_(0, at, mask)
    return attend(qs, cache_k[lo:lo + n, :, :span], cache_v[lo:lo + n, :, :span], masks).index_select(0, at)


ATTEND_TILE = 16  # rows of a prompt chunk a program of attend_chunks takes


def chunk_tiles(chunks, tile: int = ATTEND_TILE) -> list[tuple[int, int]]:
    """The tiles attend_chunks takes for chunks (first row, rows) each: (first row, rows) of up to `tile` rows."""
    return [(r0 + i, min(tile, n - i)) for r0, n in chunks for i in range(0, n, tile)]


def attend_chunks(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor,
                  rows: torch.Tensor, table: torch.Tensor, tiles: torch.Tensor, out: torch.Tensor) -> bool:
    """On a GPU with Triton: every prompt chunk of a step in one launch, into out [T, heads, hd]: row r of q
    [T, heads, hd] (at positions[r] of slot rows[r], its key and value written) against its slot's keys up to its
    position, for each row the tiles int64 [N, 2] (chunk_tiles) list; a row's result is the same in any tile, step
    or batch.  False elsewhere (the caller attends chunk by chunk)."""
    if not chunks_fused(q):
        return False
    _triton().attend_tiles(q, cache_k, cache_v, positions, rows, table, tiles, out, ATTEND_TILE)
    return True


class Linear(torch.nn.Linear):
    """nn.Linear (no bias here) whose product on the CPU is `linear`'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] times weight [out, in] transposed.  On the CPU in float32 by the form `cpu_form` chooses for T
    rows on this CPU: torch's `x @ W.T` (MKL), `(W @ x.T).T` (MKL on the transposed shapes; a lone row doubled), or
    oneDNN's product on the weight as it is (no packed copy, so the weight cache's shared pages, sleep's parking and
    a snapshot see the one weight).  Each is a float32 sum in its own order; none is bitwise equal across row
    counts.  On a GPU in bf16 or fp16, by the kernel whose rows are (rows_fused)."""
    rows = x.shape[0]
    if x.is_cuda and rows_fused(x):
        k = x.shape[-1]
        return _triton().linear_rows(x.reshape(-1, k).contiguous(), weight).view(*x.shape[:-1], weight.shape[0])
    if x.is_cuda or x.dim() != 2 or x.dtype != torch.float32:
        return F.linear(x, weight)
    form = cpu_form(rows)
    if form == "onednn" and weight.is_contiguous() and _onednn():
        return _onednn_linear(x, weight)
    if form == "transposed":
        if rows == 1:
            return (weight @ torch.cat((x, x)).t())[:, :1].t().contiguous()
        return (weight @ x.t()).t().contiguous()
    return F.linear(x, weight)


# A CPU float32 product's form by its row count, per CPU maker: (most rows, form), the first that holds.  MKL chooses
# its code by the maker: on an Intel Xeon (Sapphire Rapids, 2 threads, the `small` preset's products of a step)
# `x @ W.T` was fastest up to 8 rows (0.9 ms at 1 row against 1.2 by oneDNN), `(W @ x.T).T` from 9 to 48 (2.1 ms
# at 16 rows against 2.7 by oneDNN and 3.7 by `x @ W.T`), oneDNN's beyond (fastest at 64); on an AMD EPYC MKL's few-row
# products were slow in either form and oneDNN's fastest from 5 rows (docs/BENCHMARKS.md).
CPU_FORMS = {"GenuineIntel": ((8, "linear"), (48, "transposed"), (None, "onednn")),
             "": ((4, "transposed"), (None, "onednn"))}  # every other maker: as measured on the AMD EPYC
ONEDNN_ENV = "RESTARTKIT_ONEDNN"  # "0": the CPU's float32 products by torch's MKL only (as before oneDNN's)


def cpu_form(rows: int) -> str:
    """How a CPU float32 product of `rows` rows runs here: "linear", "transposed" or "onednn" (CPU_FORMS)."""
    return next(form for most, form in _cpu_forms() if most is None or rows <= most)


@functools.lru_cache(maxsize=1)
def _cpu_forms() -> tuple:
    return CPU_FORMS.get(cpu_maker(), CPU_FORMS[""])


def cpu_maker() -> str:
    """The CPU's maker as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD...), or "" where it does not say."""
    return cpuinfo("vendor_id")


def cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo ("vendor_id", "model name"), or "" where it does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def _onednn() -> bool:
    """Whether this torch has oneDNN's linear product for the CPU (x86 builds do), and it is not switched off."""
    if os.environ.get(ONEDNN_ENV, "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ones(5, 2)
        return bool(torch.equal(_onednn_linear(probe, torch.ones(3, 2)), torch.full((5, 3), 2.0)))
    except (AttributeError, RuntimeError):
        return False


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of gate_up [T, 2 * inter] (gate's columns, then up's)."""
    if fused(gate_up):
        return _triton().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
