"""A small, real Llama-style decoder in plain torch.

RMSNorm, rotary embeddings (the Hugging Face "rotate half" convention, so other
engines load the same checkpoint and agree), grouped-query attention, SwiGLU,
an optional mixture-of-experts MLP, and a KV cache whose block table is a
static tensor, so that one decode step has fixed shapes and can be captured
as a CUDA graph.

The KV cache has one slot per sequence the scheduler may run at once
(restartkit.reference.sched), and is held in blocks of 64 positions that a
table maps to each slot (restartkit.reference.model.paged).  A prefill runs one
sequence's tokens in its slot; a decode step runs one token of each running
sequence, each in its own slot, in one forward pass.  A CUDA graph of the step
runs over the first B slots (the engine keeps one graph for each power of two
up to max_num_seqs), its shapes static: the CPU's attention reads a slot's
whole span under a position mask, a GPU's kernel stops at each row's position.
Each slot's table has a last column past max_model_len, the scratch block's:
where a decode step writes the rows of slots that are not decoding.  Its
spare position (`scratch`) is the last the table addresses.

The decode step's elementwise work is fused on a GPU (restartkit.reference.
model.kernels: the residual add with the next norm, rotary embedding with the
KV-cache write, SwiGLU's product) and its attention is two kernels a layer
that read each row's keys up to its position only: one step of an 8B model
launches about 12 kernels a layer instead of 36 (docs/BENCHMARKS.md).  On the
CPU the same step is the plain torch form, equal to what transformers computes.

A restarted engine pays, on its first forward pass, for every kind of GPU
kernel it launches (the driver loads each kernel module on first use, 10-30 ms
each on an H200), so the forward pass keeps the kinds few: rotary tables are
computed on the host, RMSNorm is torch's fused rms_norm, and a prefill's
attention is two batched matmuls around a softmax.  scripts/gpu_startup_probe.py
--candidates measures each choice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from restartkit.reference.model import kernels, paged
from restartkit.reference.model.config import ModelConfig, UnsupportedConfig, cache_positions  # noqa: F401
from restartkit.reference.model.rope import rope_tables


@dataclass(frozen=True)
class Parallel:
    """Tensor parallelism (heads and MLP columns split across ranks) and,
    for MoE checkpoints, expert parallelism (whole experts split across the
    same ranks).  `reduce` sums a partial result across ranks."""
    tp_size: int = 1
    tp_rank: int = 0
    expert_parallel: bool = False

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            import torch.distributed as dist
            dist.all_reduce(x)
        return x

    def owns_expert(self, e: int, n_experts: int) -> bool:
        if not self.expert_parallel:
            return True
        per = n_experts // self.tp_size
        return e // per == self.tp_rank


SINGLE = Parallel()


def shard_tensor(name: str, t: torch.Tensor, cfg: "ModelConfig", par: Parallel) -> torch.Tensor | None:
    """This rank's part of a checkpoint tensor (None: the rank holds none of it).

    Column-parallel (split rows of the weight): q/k/v, gate/up, expert w1/w3.
    Row-parallel (split columns): o_proj, down_proj, expert w2.  Embedding,
    norms, router and lm_head are replicated.  With expert parallelism each
    rank holds whole experts instead of slices of every expert."""
    if par.tp_size == 1:
        return t
    if ".experts." in name:
        e = int(name.split(".experts.")[1].split(".")[0])
        if par.expert_parallel:
            return t if par.owns_expert(e, cfg.num_local_experts) else None
    col = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.", ".w1.", ".w3.")
    row = (".o_proj.", ".down_proj.", ".w2.")
    if any(k in name for k in col):
        return t.chunk(par.tp_size, dim=0)[par.tp_rank].contiguous()
    if any(k in name for k in row):
        return t.chunk(par.tp_size, dim=1)[par.tp_rank].contiguous()
    return t


def check_parallel(cfg: "ModelConfig", par: Parallel) -> str | None:
    tp = par.tp_size
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % tp:
            return f"{what} = {n} is not divisible by tensor_parallel_size = {tp}"
    if par.expert_parallel and (not cfg.is_moe or cfg.num_local_experts % tp):
        return "expert parallelism needs a MoE checkpoint whose expert count divides by the parallel size"
    return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32, then back to the activations' dtype before the weight (as Hugging Face's Llama)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


apply_rope = kernels.rotate  # x [T, heads, head_dim]; cos, sin (first half negated) [T, head_dim] in x's dtype


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel = SINGLE):
        super().__init__()
        hd = cfg.head_dim
        self.par = par
        self.n_heads = cfg.num_attention_heads // par.tp_size
        self.n_kv = cfg.num_key_value_heads // par.tp_size
        self.head_dim = hd
        # q, k and v in one matrix product (restartkit.reference.model.weights fuses the checkpoint's three)
        self.qkv_proj = kernels.Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * hd, bias=False)
        self.o_proj = kernels.Linear(self.n_heads * hd, cfg.hidden_size, bias=False)

    def decode(self, x, tables, positions, rows, in_place, cache_k, cache_v, table, mask):
        """One token of each of B sequences: x [B, hidden], row b at positions[b] in slot rows[b] of cache_k,
        cache_v [n_kv, blocks, BLOCK, hd] by the block table (paged.Table); in_place: rows are the first B slots,
        each in its home blocks (read in place), else their keys are gathered; tables: the rotary (cos, sin); mask:
        as `attend` takes it."""
        B, hd = x.shape[0], self.head_dim
        q, k, v = self.qkv(x)
        q = kernels.rope_write_kv(q, k, v, *tables, positions, rows, cache_k, cache_v, table.device)
        out = self.attend_rows(q, positions, rows, in_place, cache_k, cache_v, table, mask)
        return self.par.reduce(self.o_proj(out.reshape(B, self.n_heads * hd)))

    def attend_rows(self, q, positions, rows, in_place, cache_k, cache_v, table, mask):
        """Each decode row's attention over its slot's keys up to its position, q [B, heads, hd]: the decode kernel
        on a GPU, else matrix products over the keys `mask` spans (as kernels.attend takes it).  [B, heads, hd]."""
        B, hd, n_kv = q.shape[0], self.head_dim, self.n_kv
        out = kernels.attend_decode(q, cache_k, cache_v, positions, rows, table.device)
        if out is not None:
            return out
        span = mask.shape[-1]  # the keys attended to: every position, or those up to the batch's last
        if not in_place and not rows.is_cuda and (slots := paged.covering(table, rows.tolist())) is not None:
            return kernels.attend_slots(q.view(B, n_kv, self.n_heads // n_kv, hd), cache_k, cache_v, *slots, rows,
                                        mask).reshape(B, self.n_heads, hd)
        keys = paged.row_keys(cache_k, table, rows, span, in_place)
        values = paged.row_keys(cache_v, table, rows, span, in_place)
        return kernels.attend(q.view(B, n_kv, self.n_heads // n_kv, hd), keys, values, mask).reshape(
            B, self.n_heads, hd)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, hd], k and v [T, kv_heads, hd] of x [T, hidden]: views of one matrix product."""
        T, hd = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        return q.view(T, self.n_heads, hd), k.view(T, self.n_kv, hd), v.view(T, self.n_kv, hd)

    def forward(self, x, tables, positions, rows, slot, cache_k, cache_v, table, blocked, tiles=None):
        """One sequence's T tokens in slot `slot` (rows: that slot, T times) of cache_k, cache_v [n_kv, blocks,
        BLOCK, hd] by the block table; tables: the rotary (cos, sin); blocked: [T, span], True where query t may
        not see key j; tiles: the T rows as kernels.attend_chunks takes them (a GPU's, so that these rows attend as
        a mixed step's chunk does), or None."""
        q, k, v = self.qkv(x)
        q = kernels.rope_write_kv(q, k, v, *tables, positions, rows, cache_k, cache_v, table.device)
        out = torch.empty_like(q) if tiles is not None else None
        if out is None or not kernels.attend_chunks(q, cache_k, cache_v, positions, rows, table.device, tiles, out):
            out = self.attend_segment(q, cache_k, cache_v, table, slot, blocked)
        return self.par.reduce(self.o_proj(out.reshape(x.shape[0], self.n_heads * self.head_dim)))

    def attend_segment(self, q, cache_k, cache_v, table, slot, blocked):
        """Consecutive tokens of one sequence, q [T, heads, hd] (their keys and values written), against its
        slot's keys and values: matrix products over the keys up to the last of them (blocked [T, span], True
        where query t may not see key j).  Returns [T, heads, hd]."""
        span = blocked.shape[-1]  # keys up to the last position of these tokens
        cache_k, cache_v = paged.slot_keys(cache_k, table, slot, span), paged.slot_keys(cache_v, table, slot, span)
        return self.attend_keys(q, cache_k, cache_v, blocked)

    def attend_keys(self, q, cache_k, cache_v, blocked):
        """Consecutive tokens of one sequence, q [T, heads, hd], against its keys and values [kv_heads, span, hd]
        (their own the last T): a GPU's fused attention, causal from the bottom right; elsewhere matrix products
        (blocked [T, span], True where query t may not see key j; unused on a GPU, may be None there).  Returns
        [T, heads, hd]."""
        T, hd, n_kv = q.shape[0], self.head_dim, self.n_kv
        group = self.n_heads // n_kv  # query heads per KV head
        span = cache_k.shape[1]
        if q.is_cuda:  # fused attention (flash in bf16): no [heads, T, span] scores in memory (2x faster at 8B)
            keys, values = (c.repeat_interleave(group, dim=0).unsqueeze(0) for c in (cache_k, cache_v))
            out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values,
                                                 attn_mask=causal_lower_right(T, span))  # the T last of span
            return out[0].transpose(0, 1)
        # query head h reads KV head h // group: per KV head, its group's queries are rows (g, t)
        q = q.view(T, n_kv, group, hd).permute(1, 2, 0, 3).reshape(n_kv, group * T, hd)
        scores = torch.bmm(q, cache_k.transpose(1, 2)).float() * hd ** -0.5  # [n_kv, group*T, span]
        probs = scores.masked_fill(blocked.repeat(group, 1), float("-inf")).softmax(-1).to(q.dtype)
        return torch.bmm(probs, cache_v).view(n_kv, group, T, hd).permute(2, 0, 1, 3).reshape(T, self.n_heads, hd)

    def mixed(self, x, tables, step: "MixedStep", cache_k, cache_v, table):
        """A step of decode rows and prompt chunks together (MixedStep): one matrix product for q, k and v
        and one for the output, every row's key and value written before any row attends; the decode rows'
        attention in one call (a GPU's decode kernel, else matrix products over their gathered slots), each
        chunk's over its own slot."""
        T, hd = x.shape[0], self.head_dim
        q, k, v = self.qkv(x)
        q = kernels.rope_write_kv(q, k, v, *tables, step.positions, step.rows, cache_k, cache_v, table.device)
        out = torch.empty_like(q)
        if step.singles is not None:
            idx, pos, rows = step.singles
            qs = q.index_select(0, idx)
            out.index_copy_(0, idx, self.attend_rows(qs, pos, rows, step.in_place, cache_k, cache_v, table,
                                                     step.single_mask))
        if step.chunks and not kernels.attend_chunks(q, cache_k, cache_v, step.positions, step.rows, table.device,
                                                     step.tiles, out):
            for r0, n, slot, blocked in step.chunks:
                out[r0:r0 + n] = self.attend_segment(q[r0:r0 + n], cache_k, cache_v, table, slot, blocked)
        return self.par.reduce(self.o_proj(out.reshape(T, self.n_heads * hd)))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, par: Parallel = SINGLE):
        super().__init__()
        self.par = par
        inter //= par.tp_size
        self.gate_up_proj = kernels.Linear(hidden, 2 * inter, bias=False)  # gate's rows, then up's
        self.down_proj = kernels.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.par.reduce(self.down_proj(kernels.silu_mul(self.gate_up_proj(x))))


class Expert(nn.Module):
    """One expert in the Mixtral naming (w1 gate, w3 up, w2 down)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = kernels.Linear(hidden, inter, bias=False)
        self.w2 = kernels.Linear(inter, hidden, bias=False)
        self.w3 = kernels.Linear(hidden, inter, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-k routed experts.  Dense evaluation (every expert on every token,
    weighted by a mask): static shapes, so decode stays graph-capturable."""

    def __init__(self, cfg: ModelConfig, par: Parallel = SINGLE):
        super().__init__()
        self.par = par
        self.top_k = cfg.num_experts_per_tok
        self.gate = kernels.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        n = cfg.num_local_experts
        # Expert parallel: this rank holds whole experts (others are None).
        # Tensor parallel: every rank holds a slice of every expert.
        inter = cfg.intermediate_size if par.expert_parallel else cfg.intermediate_size // par.tp_size
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, inter) if par.owns_expert(e, n) else nn.Identity() for e in range(n))

    def forward(self, x):
        logits = self.gate(x).float()
        weights, chosen = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        dense = torch.zeros_like(logits).scatter(-1, chosen, weights).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if isinstance(expert, Expert):
                out = out + expert(x) * dense[:, e : e + 1]
        return self.par.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe:
            self.block_sparse_moe = SparseMoE(cfg, par)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, par)

    def forward(self, x, delta, tables, positions, rows, slot, cache_k, cache_v, table, blocked, tiles=None):
        """This layer on one sequence's tokens, as `decode` takes the residual stream and delta."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        x, h = kernels.add_rms_norm(x, delta, norm1.weight, norm1.eps)
        attn = self.self_attn(h, tables, positions, rows, slot, cache_k, cache_v, table, blocked, tiles)
        x, h = kernels.add_rms_norm(x, attn, norm2.weight, norm2.eps)
        return x, self.feed_forward(h)

    def decode(self, x, delta, tables, positions, rows, in_place, cache_k, cache_v, table, mask):
        """This layer's decode step on the residual stream x and the previous layer's output not yet added
        (delta; None at the first layer): each add goes with the norm after it (kernels.add_rms_norm).
        Returns (the stream, this layer's output not yet added)."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        x, h = kernels.add_rms_norm(x, delta, norm1.weight, norm1.eps)
        attn = self.self_attn.decode(h, tables, positions, rows, in_place, cache_k, cache_v, table, mask)
        x, h = kernels.add_rms_norm(x, attn, norm2.weight, norm2.eps)
        return x, self.feed_forward(h)

    def mixed(self, x, delta, tables, step, cache_k, cache_v, table):
        """This layer on a mixed step's rows (Attention.mixed), as `decode` takes the stream and delta."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        x, h = kernels.add_rms_norm(x, delta, norm1.weight, norm1.eps)
        attn = self.self_attn.mixed(h, tables, step, cache_k, cache_v, table)
        x, h = kernels.add_rms_norm(x, attn, norm2.weight, norm2.eps)
        return x, self.feed_forward(h)

    def feed_forward(self, x):
        ff = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return ff(x)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel = SINGLE):
        super().__init__()
        # An explicit weight skips the random init (weights come from a checkpoint;
        # on the meta device that init alone costs a second of imports).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, par) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match the Hugging Face checkpoint names exactly."""

    def __init__(self, cfg: ModelConfig, par: Parallel = SINGLE):
        super().__init__()
        self.config = cfg
        self.par = par
        self.model = Backbone(cfg, par)
        self.lm_head = kernels.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cache_k: torch.Tensor | None = None
        self.cache_v: torch.Tensor | None = None
        self.kv: paged.Table | None = None  # the block table
        self.max_len = self.slots = 0
        self._cos = self._sin = self._key_pos = None

    def tie(self) -> None:
        """tie_word_embeddings: the output projection is the embedding (one tensor); again after each
        time the embedding is replaced (a load, a sleep, a wake)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- KV cache -------------------------------------------------------
    def allocate_kv_cache(self, max_len: int, slots: int = 1, rows: int | None = None) -> int:
        """Allocate the KV cache (restartkit.reference.model.paged): `rows` rows of blocks (None: one per slot, each
        a sequence of max_len and the spare block) for `slots` sequences of up to max_len tokens; returns its size
        in bytes."""
        cfg = self.config
        ref = self.lm_head.weight
        positions = cache_positions(max_len)
        rows = rows or slots
        shape = (cfg.num_hidden_layers, rows, cfg.num_key_value_heads // self.par.tp_size, positions, cfg.head_dim)
        self.cache_k = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
        self.cache_v = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
        self.kv = paged.Table(slots, positions // paged.BLOCK, rows, ref.device)
        self.max_len, self.slots = max_len, slots
        self._cos, self._sin = rope_tables(cfg.head_dim, positions, cfg.rope_theta, ref.dtype, ref.device, cfg.rope)
        self._key_pos = torch.arange(positions).to(ref.device)
        return 2 * self.cache_k.numel() * self.cache_k.element_size()

    @property
    def scratch(self) -> int:
        """The spare position of every slot, its last: a decode step over every slot writes there for a slot not
        decoding (and its attention reads the first keys only: kernels.attend_decode)."""
        return cache_positions(self.max_len) - 1

    def drop_kv_cache(self) -> None:
        self.cache_k = self.cache_v = self.kv = None

    @property
    def kv_cache_bytes(self) -> int:
        if self.cache_k is None:
            return 0
        return 2 * self.cache_k.numel() * self.cache_k.element_size()

    # ---- forward ----------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int = 0, end: int | None = None) -> torch.Tensor:
        """One sequence: tokens, positions int64 [T] (consecutive: a prompt's chunk, or draft tokens being
        checked; `end`: the last one + 1, when the caller knows it), in KV-cache slot `slot`.  Returns float32
        logits [T, vocab]."""
        # query i may not see key j when j > position_i; keys past the last position are not read at all
        span = end if end is not None else int(positions[-1]) + 1
        blocked = self._key_pos[:span].unsqueeze(0) > positions.unsqueeze(1)
        rows = positions.new_full(positions.shape, slot)
        # where a mixed step's chunks attend in one launch, these rows attend by the same kernel: a prompt's greedy
        # tokens do not depend on whether it prefilled alone or beside running streams
        tiles = None
        if kernels.chunks_fused(tokens):
            tiles = torch.tensor(kernels.chunk_tiles([(0, len(tokens))]), dtype=torch.long, device=tokens.device)
        x, delta = self.model.embed_tokens(tokens), None
        for i, layer in enumerate(self.model.layers):
            x, delta = layer(x, delta, (self._cos, self._sin), positions, rows, slot, self.cache_k[i],
                             self.cache_v[i], self.kv, blocked, tiles)
        norm = self.model.norm
        return self.lm_head(kernels.add_rms_norm(x, delta, norm.weight, norm.eps)[1]).float()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None,
               span: int | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """One token of each of B sequences: tokens, positions int64 [B], row b in slot slots[b] (None: row b
        in slot b, the first B slots, as a CUDA graph runs); `span`: attend to the first span positions only
        (more than the batch's last; None: every position, as a CUDA graph must).  Returns float32 logits
        [B, vocab], or of the rows `keep` only.  Rows may share a slot at consecutive positions (a prompt's
        tokens, as a prefill graph runs them): each row's key and value are written before any row attends."""
        rows = self._key_pos[: tokens.shape[0]] if slots is None else slots
        in_place = slots is None and self.kv.in_place(range(tokens.shape[0]))
        mask = self._key_pos[:span].unsqueeze(0) > positions.unsqueeze(1)  # True: key j is past row b's position
        x, delta = self.model.embed_tokens(tokens), None
        for i, layer in enumerate(self.model.layers):
            x, delta = layer.decode(x, delta, (self._cos, self._sin), positions, rows, in_place,
                                    self.cache_k[i], self.cache_v[i], self.kv, mask)
        if keep is not None:
            x, delta = x.index_select(0, keep), delta.index_select(0, keep)
        norm = self.model.norm
        return self.lm_head(kernels.add_rms_norm(x, delta, norm.weight, norm.eps)[1]).float()

    def mixed(self, tokens: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
        """Running sequences' next tokens and prompts' chunks in one forward pass (restartkit.reference.sched's
        token budget): tokens int64 [T] in row order; segments (slot, first position, length) each.  Returns the
        logits of each segment's last row [len(segments), vocab], in the model's dtype (a GPU takes the argmax where
        they are)."""
        step = MixedStep.build(segments, self._key_pos, self.kv)
        x, delta = self.model.embed_tokens(tokens), None
        for i, layer in enumerate(self.model.layers):
            x, delta = layer.mixed(x, delta, (self._cos, self._sin), step, self.cache_k[i], self.cache_v[i], self.kv)
        x, delta = x.index_select(0, step.last), delta.index_select(0, step.last)
        norm = self.model.norm
        return self.lm_head(kernels.add_rms_norm(x, delta, norm.weight, norm.eps)[1])


@dataclass
class MixedStep:
    """The rows of a mixed step on the device: segments of consecutive tokens of one sequence each (a running
    sequence's next token, or a chunk of a prompt), their positions and slots (rows), the length-1 segments'
    rows gathered (singles: row indices, positions, slots; single_mask: their keys past their positions, for the
    CPU's attention), and each longer one's (first row, length, slot, blocked: [n, span] keys it may not see)."""
    positions: torch.Tensor
    rows: torch.Tensor
    singles: tuple | None
    single_mask: torch.Tensor | None
    chunks: list
    tiles: torch.Tensor | None  # the chunks' rows as kernels.attend_chunks takes them (None: no chunk)
    last: torch.Tensor  # each segment's last row: whose logits come back
    in_place: bool = False  # the length-1 segments are in slots 0, 1, ... in row order, each in its home blocks

    @classmethod
    def build(cls, segments: list[tuple[int, int, int]], key_pos: torch.Tensor, table) -> "MixedStep":
        """segments: (slot, first position, length) each, in row order."""
        dev = key_pos.device
        positions, rows, singles, chunks, last, r0 = [], [], [], [], [], 0
        for slot, p0, n in segments:
            positions += range(p0, p0 + n)
            rows += [slot] * n
            if n == 1:
                singles.append((r0, p0, slot))
            else:
                chunks.append((r0, n, slot, p0))
            r0 += n
            last.append(r0 - 1)
        pos_t = torch.tensor(positions, device=dev)
        chunk_rows = [(r, n, slot, key_pos[:p0 + n].unsqueeze(0) > pos_t[r:r + n].unsqueeze(1))
                      for r, n, slot, p0 in chunks]
        single, mask = None, None
        if singles:
            idx, pos, slots = (torch.tensor(col, device=dev) for col in zip(*singles))
            single = idx, pos, slots
            mask = key_pos[:max(p for _, p, _ in singles) + 1].unsqueeze(0) > pos.unsqueeze(1)
        first = [slot for _, _, slot in singles] == list(range(len(singles)))
        first = first and bool(singles) and table.in_place(range(len(singles)))
        tiles = kernels.chunk_tiles([(r, n) for r, n, _, _ in chunks])
        tiles = torch.tensor(tiles, dtype=torch.long, device=dev) if tiles else None
        return cls(pos_t, torch.tensor(rows, device=dev), single, mask, chunk_rows, tiles,
                   torch.tensor(last, device=dev), first)


def init_std(cfg: ModelConfig, name: str) -> float:
    """Weight scale for seeded random checkpoints: small enough that
    activations stay finite, large enough that greedy output varies."""
    if name.endswith("norm.weight"):
        return 0.0
    if "embed_tokens" in name:
        return 1.0
    return 1.0 / math.sqrt(cfg.hidden_size)
