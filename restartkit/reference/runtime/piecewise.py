"""A mixed step (decode rows and prompt chunks in one forward pass: restartkit.reference.sched's token budget) as
CUDA graphs.

Eagerly, a mixed step at 8B shapes on an H200 spent more time on the host than on the device: 19.4 ms for 63
decode rows and a 448-token chunk, whose kernels took 14.2 ms (about 0.6 ms of Python and launches a layer;
docs/BENCHMARKS.md), and under load the HTTP threads' share of the interpreter stretched it further.  Once its
rows are padded, everything in such a step has a static shape but its chunks' attention, whose keys grow with
each prompt.  Where Triton runs (a GPU), that attention is one launch over a static table of tiles
(kernels.attend_chunks: each program a tile of a chunk's rows, reading its slot's keys up to each row's position;
spare tiles do nothing), so the whole step is one graph.  Elsewhere the step runs as pieces, from one layer's
attention output to the next layer's queries (the output projection, the norms, the MLP, q, k and v, the rotary
embedding and the KV write, and the decode rows' attention), with each chunk's attention run eagerly between
them (torch's attention over the chunk's span of keys); on the CPU the pieces run without graphs
(tests/reference/test_token_budget.py checks them).

Where the step is one graph, a prompt prefilled alone (no decode row) runs as such a step too (the runner's
`prefill`): every prompt row attends by the one-launch kernel, alone or beside others (the decode kernel and
torch's attention round differently in bf16).  The matrix products still round by the step's row count: on an H100
bf16 greedy answers under batching differ with or without this (docs/BENCHMARKS.md).

The step's rows: first b decode rows, row r for slot r (b: the smallest decode graph size above the highest slot
decoding; a slot not decoding writes at its spare position and reads a few keys, as in a decode graph), then the
chunks' rows in order, padded to C rows (CHUNK_SIZES) with rows at the spare position.  The residual stream, the
queries and the attention output live in static buffers of the largest step, shared by every (b, C).  Each
segment's logits (a decode row's, a chunk's last row's) come back in the order the step listed them.

A (b, C) is captured the first time a step needs it, right after that step ran through the same pieces eagerly
(the capture records and computes nothing: no key or value is written twice), and kept until the KV cache is let
go (restartkit.reference.runtime.runner.drop_graph): nothing is captured at a start, so no restart waits for these
graphs.  Steps of more than MAX_CHUNKS chunks or more chunk tokens than the largest size run eagerly (the runner's
mixed step).
"""
from __future__ import annotations

import os

import torch

from restartkit.reference.model import kernels, paged
from restartkit.reference.runtime.graphs import graph_sizes

CHUNK_SIZES = (*range(64, 513, 64), 768, 1024, 1536, 2048)  # a step's chunk rows, padded up to one of these
MAX_CHUNKS = 8  # prompt chunks a graphed step takes
ENV = "RESTARTKIT_MIXED_GRAPHS"  # "0": mixed steps eagerly (on an H100 at 64 clients 1,903 against 2,220 tok/s)
# RESTARTKIT_MIXED_GRAPHS=0 and RESTARTKIT_CHUNK_KERNEL=0 together: the mixed step as the H200 ran it before both


def mixed_graphs(model, dev: torch.device) -> "MixedGraphs | None":
    """A GPU engine's mixed-step graphs, unless ENV turns them off."""
    return MixedGraphs(model, dev) if os.environ.get(ENV, "1") != "0" else None


class MixedGraphs:
    """The pieces of a mixed step over one model and its KV cache (see the module's docstring); `capture`: as CUDA
    graphs (a GPU), else eagerly, piece by piece."""

    def __init__(self, model, dev: torch.device, capture: bool = True):
        self.model, self.dev = model, dev
        self.capture = capture and dev.type == "cuda"
        self.layers = len(model.model.layers)
        self.scratch = model.scratch
        self.decode_sizes = [0, *graph_sizes(model.slots)]
        attn = model.model.layers[0].self_attn
        dtype = model.lm_head.weight.dtype
        rows = model.slots + CHUNK_SIZES[-1]
        self.inputs = torch.zeros((3, rows), dtype=torch.long, device=dev)  # tokens, positions, slots
        self.keep = torch.zeros(model.slots + MAX_CHUNKS, dtype=torch.long, device=dev)  # each segment's row
        # the chunks' attention in one launch over these tiles (kernels.attend_chunks): a GPU with Triton
        self.tiles = torch.zeros((self._tile_count(CHUNK_SIZES[-1]), 2), dtype=torch.long, device=dev)
        self.staging = torch.zeros(3 * rows + len(self.keep) + self.tiles.numel(), dtype=torch.long)
        if self.capture:
            self.staging = self.staging.pin_memory()
        self.copied = torch.cuda.Event() if self.capture else None  # the last step's inputs left the staging buffer
        hidden = model.config.hidden_size
        self.x = torch.zeros(rows, hidden, dtype=dtype, device=dev)  # the residual stream
        self.q = torch.zeros(rows, attn.n_heads, attn.head_dim, dtype=dtype, device=dev)
        self.whole = self.capture and kernels.chunks_fused(self.q)  # one graph a step, its chunks' attention in it
        self.out = torch.zeros(rows, attn.n_heads, attn.head_dim, dtype=dtype, device=dev)  # attention output
        self.logits = torch.zeros(len(self.keep), model.config.vocab_size, dtype=dtype, device=dev)
        self.graphs: dict[tuple[int, int], list | None] = {}  # (b, C): a graph per piece; None: its capture failed
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.stream = torch.cuda.Stream(dev) if self.capture else None
        self.counts = {"graphed": 0, "eager": 0, "captured": 0, "capture_failed": 0}
        self._decode_span = 0  # the CPU's decode attention: keys up to the highest decode row's position

    def run(self, segments: list[tuple[int, int, list[int]]]) -> torch.Tensor | None:
        """One mixed step: segments (slot, first position, tokens) as the runner's `mixed` takes them.  The logits of
        each segment's last token [len(segments), vocab] in the model's dtype (a view of a static buffer, good until
        the next step); None when the step is not for these pieces (too many chunks or chunk tokens)."""
        singles = [(i, slot, p0, t[0]) for i, (slot, p0, t) in enumerate(segments) if len(t) == 1]
        chunks = [(i, slot, p0, t) for i, (slot, p0, t) in enumerate(segments) if len(t) > 1]
        n_chunk = sum(len(t) for _, _, _, t in chunks)
        if len(chunks) > MAX_CHUNKS or n_chunk > CHUNK_SIZES[-1]:
            return None
        b = next(size for size in self.decode_sizes if size > max((s for _, s, _, _ in singles), default=-1))
        c = next((size for size in CHUNK_SIZES if size >= n_chunk), 0) if chunks else 0
        spans = self._fill(b, c, singles, chunks)
        key = (b, c)
        graphs = self.graphs.get(key)
        if graphs:
            for i, graph in enumerate(graphs):
                graph.replay()
                if not self.whole and i < self.layers:
                    self._attend_chunks(i, b, c, spans)
        else:
            self._forward(b, c, spans)
        self.counts["graphed" if graphs else "eager"] += 1
        if self.capture and key not in self.graphs:
            self._capture(key)
        return self.logits[:len(segments)]

    def _forward(self, b: int, c: int, spans) -> None:
        """The step through its pieces, eagerly."""
        for i in range(self.layers + 1):
            self._piece(i, b, b + c)
            if i < self.layers:
                self._attend_chunks(i, b, c, spans)

    def _fill(self, b: int, c: int, singles, chunks) -> list[tuple[int, int, int, int, torch.Tensor | None, object]]:
        """The step's inputs into the static buffers; returns each chunk's (first row, rows, slot, span, blocks,
        blocked) for its attention."""
        rows = b + c
        tok, pos, slot_of = [0] * rows, [self.scratch] * rows, [*range(b), *[0] * c]
        keep = [0] * len(self.keep)
        for i, slot, p0, token in singles:
            tok[slot], pos[slot], keep[i] = token, p0, slot
        spans, r = [], b
        model = self.model
        for i, slot, p0, tokens in chunks:
            n = len(tokens)
            tok[r:r + n], pos[r:r + n], slot_of[r:r + n] = tokens, range(p0, p0 + n), [slot] * n
            keep[i] = r + n - 1
            end = p0 + n
            blocked = None
            if not self.capture:  # the CPU's attention masks: query t may not see the keys past its position
                blocked = model._key_pos[:end].unsqueeze(0) > torch.arange(p0, end).unsqueeze(1)
            blocks = None if self.whole else paged.slot_blocks(model.kv, slot, end, self.dev)
            spans.append((r, n, slot, end, blocks, blocked))
            r += n
        self._decode_span = max((p0 for _, _, p0, _ in singles), default=0) + 1
        full = len(self.inputs[0])
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has left the pinned buffer
        tiles = kernels.chunk_tiles([(r, n) for r, n, *_ in spans])
        tiles += [(0, 0)] * (len(self.tiles) - len(tiles))
        at = 3 * full + len(keep)
        self.staging[:3 * full].view(3, full)[:, :rows].copy_(torch.tensor([tok, pos, slot_of]))
        self.staging[3 * full:at].copy_(torch.tensor(keep))
        self.staging[at:].copy_(torch.tensor(tiles).view(-1))
        self.inputs[:, :rows].copy_(self.staging[:3 * full].view(3, full)[:, :rows], non_blocking=True)
        self.keep.copy_(self.staging[3 * full:at], non_blocking=True)
        self.tiles.view(-1).copy_(self.staging[at:], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return spans

    def _piece(self, i: int, b: int, rows: int) -> None:
        """Piece i of a step of b decode rows and `rows` rows in all: layer i-1's attention output through its
        MLP (none before layer 0: the embedding), then layer i's queries, keys and values, the keys and values
        written, and the decode rows' attention; piece L (the last) ends in the logits."""
        model, x = self.model, self.x[:rows]
        layers, delta = model.model.layers, None
        if i == 0:
            x.copy_(model.model.embed_tokens(self.inputs[0, :rows]))
        else:
            layer = layers[i - 1]
            attn = layer.self_attn
            out = attn.par.reduce(attn.o_proj(self.out[:rows].view(rows, -1)))
            norm = layer.post_attention_layernorm
            summed, h = kernels.add_rms_norm(x, out, norm.weight, norm.eps)
            x.copy_(summed)
            delta = layer.feed_forward(h)
        if i == self.layers:
            keep = self.keep[:b + MAX_CHUNKS]
            norm = model.model.norm
            h = kernels.add_rms_norm(x.index_select(0, keep), delta.index_select(0, keep), norm.weight, norm.eps)[1]
            self.logits[:len(keep)].copy_(model.lm_head(h))
            return
        layer = layers[i]
        attn, norm = layer.self_attn, layer.input_layernorm
        summed, h = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        if delta is not None:
            x.copy_(summed)
        q, k, v = attn.qkv(h)
        positions, slots = self.inputs[1, :rows], self.inputs[2, :rows]
        q = kernels.rope_write_kv(q, k, v, model._cos, model._sin, positions, slots, model.cache_k[i],
                                  model.cache_v[i], model.kv.device)
        self.q[:rows].copy_(q)
        if b:
            self.out[:b].copy_(self._attend_decode(attn, q[:b], i, positions[:b], slots[:b]))

    def _attend_decode(self, attn, q, i, positions, slots):
        """The decode rows' attention [b, heads, hd] (Attention.attend_rows; the CPU's keys up to the highest decode
        row's position)."""
        model = self.model
        mask = None if q.is_cuda else model._key_pos[:self._decode_span].unsqueeze(0) > positions.unsqueeze(1)
        return attn.attend_rows(q, positions, slots, False, model.cache_k[i], model.cache_v[i], model.kv, mask)

    def _attend_chunks(self, i: int, b: int, c: int, spans) -> None:
        """Layer i's attention of the step's chunks, from the static queries into the static output: one launch over
        the static tiles (kernels.attend_chunks, a GPU with Triton), else eagerly, chunk by chunk."""
        model = self.model
        attn = model.model.layers[i].self_attn
        if self.whole:
            rows = b + c
            kernels.attend_chunks(self.q[:rows], model.cache_k[i], model.cache_v[i], self.inputs[1, :rows],
                                  self.inputs[2, :rows], model.kv.device, self.tiles[:self._tile_count(c)],
                                  self.out[:rows])
            return
        for r, n, slot, end, blocks, blocked in spans:
            keys = paged.keys_at(model.cache_k[i], blocks, slot, end)
            values = paged.keys_at(model.cache_v[i], blocks, slot, end)
            self.out[r:r + n] = attn.attend_keys(self.q[r:r + n], keys, values, blocked)

    @staticmethod
    def _tile_count(c: int) -> int:
        """The tiles a step of c chunk rows launches: enough for MAX_CHUNKS chunks of any lengths summing to c."""
        return -(-c // kernels.ATTEND_TILE) + MAX_CHUNKS

    def _capture(self, key: tuple[int, int]) -> None:
        """(b, C)'s step as graphs in the pool they share: one graph (the chunks' attention in it, `whole`), else a
        graph per piece; on failure that size runs eagerly from then on."""
        b, c = key
        graphs = []
        try:
            self.stream.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(self.stream):
                for i in range(1 if self.whole else self.layers + 1):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        if self.whole:
                            self._forward(b, c, None)
                        else:
                            self._piece(i, b, b + c)
                    finally:
                        graph.capture_end()
                    graphs.append(graph)
            torch.cuda.current_stream(self.dev).wait_stream(self.stream)
        except RuntimeError:
            self.graphs[key] = None
            self.counts["capture_failed"] += 1
            return
        self.graphs[key] = graphs
        self.counts["captured"] += 1
