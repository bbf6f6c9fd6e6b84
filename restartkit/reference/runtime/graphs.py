"""CUDA graphs of the decode step, one for each batch size the engine keeps, and of short prefills.

A graph of one decode step runs over the first B KV-cache slots: row b is slot b, its token and position read
from static inputs; a slot not decoding among them writes at its spare position (LlamaForCausalLM.scratch) and
attends to a few keys only.  The engine keeps a graph for each power of two below its slot count and one for the
slot count itself (8 slots: 1, 2, 4, 8), all in one memory pool, and a step runs the smallest that holds its
highest slot; the scheduler gives each sequence the lowest free slot, so one stream runs the one-row graph.

A prefill graph runs a prompt chunk of up to 16, 64 or 128 tokens as decode rows of one slot at consecutive
positions (padded with rows at the spare position) and keeps the last token's logits.  Where a mixed step is one
graph (restartkit.reference.runtime.piecewise, a GPU's default), none is kept: a prompt prefilled alone runs as a
mixed step of one chunk, so that its rows attend by the kernel they would attend by beside running streams.
Eagerly, a short prefill at 8B shapes waited on the host: 14-22 ms for 3 tokens whose kernels took 6.3 ms; through
a graph 64 tokens took 6.4 ms, 128 tokens 9.4 ms.  The decode attention reads each row's keys again, so longer
chunks run eagerly (256 tokens: 18.8 ms in a graph, 512: 48.7 ms, against 25.5 ms eager).

What this buys, measured on an H200 at 8B shapes (docs/BENCHMARKS.md): a step over one row 4.65-4.90 ms against
4.8-5.1 ms over eight; a 1-token request 7.2 ms end to end through HTTP (22.7 ms with eager prefills).  What it
costs: the captures, paid at a start and at a KV-cache restore (four decode graphs took 0.10-0.23 s); and a
prompt's greedy tokens could depend on the batch size its step ran at (a matrix product's kernel is chosen by its
row count: on the H200 the one-row and eight-row graphs gave bit-identical logits), which is one reason
restartkit's canary runs in a batch of its own (restartkit.reference.sched).  A prompt's path (graph or eager)
depends on its length only, so a restarted engine prefills it as the last one did.
"""
from __future__ import annotations

import torch


PREFILL_SIZES = (16, 64, 128)  # prompt tokens a prefill graph takes (longer chunks run eagerly: see below)


def prefill_sizes(max_len: int) -> list[int]:
    """The prompt lengths the engine captures a prefill graph for: PREFILL_SIZES, none over max_len."""
    return sorted({min(size, max_len) for size in PREFILL_SIZES})


def graph_sizes(slots: int) -> list[int]:
    """The batch sizes the engine captures: powers of two below `slots`, and `slots`."""
    sizes, b = [], 1
    while b < slots:
        sizes.append(b)
        b *= 2
    return [*sizes, slots]


class Launch:
    """A decode step on its way: each slot's likeliest token, read by `tokens` (which waits for the step).  A
    graph's Launch is read before the launch after next, which reuses its host buffer (the scheduler reads each
    step before it launches the one after the step run ahead)."""

    def __init__(self, values: torch.Tensor, slots: list[int], event=None, by_slot: bool = True):
        self.values, self.slots, self.event = values, slots, event
        self.by_slot = by_slot  # values indexed by slot (a graph's), or row by row in the order of `slots`
        self._read: list[int] | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def tokens(self, slots: list[int]) -> list[int]:
        """The likeliest token of each of `slots` (all of them among this step's)."""
        if self._read is None:
            self.wait()
            self._read = self.values.tolist()
        at = {s: s for s in self.slots} if self.by_slot else {s: i for i, s in enumerate(self.slots)}
        return [self._read[at[s]] for s in slots]


class DecodeGraphs:
    """The captured decode steps of one model.  A step copies its inputs (tokens, positions, the rows wanted and
    which slots are chained, of every slot) from pinned host memory, replays one graph, and copies its greedy
    tokens back to pinned host memory: three launches and no wait, so the host can prepare the next step while
    the device runs this one.  A chained slot's token is the one this slot's last step chose on the device
    (the scheduler runs a greedy step ahead before it has read the last one's token).  Host buffers alternate
    between two steps, so at most two steps are in flight."""

    def __init__(self, model, dev: torch.device, prefills: bool = True):
        self.model, self.scratch = model, model.scratch
        self.sizes = graph_sizes(model.slots)
        self.inputs = torch.zeros((4, model.slots), dtype=torch.long, device=dev)  # tokens, positions, rows, chained
        self.inputs[1].fill_(self.scratch)
        self.greedy = torch.zeros(model.slots, dtype=torch.long, device=dev)  # each slot's last greedy token
        self.staging = [torch.zeros((4, model.slots), dtype=torch.long).pin_memory() for _ in range(2)]
        self.outbox = [torch.zeros(model.slots, dtype=torch.long).pin_memory() for _ in range(2)]
        self.landed = [torch.cuda.Event() for _ in range(2)]  # each buffer pair's last step is done
        self.turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outs: dict[int, torch.Tensor] = {}
        # prefill graphs: a prompt's tokens as rows of one slot at consecutive positions, padded to the graph's
        # size with rows at the spare position; the last token's logits only (`prefills` False: none, the engine
        # prefills as it runs a mixed step)
        self.prompt_sizes = prefill_sizes(model.max_len) if prefills else []
        longest = self.prompt_sizes[-1] if prefills else 1
        self.prompt = torch.zeros((4, longest), dtype=torch.long, device=dev)  # tokens, positions, rows, [the last]
        self.prompt[1].fill_(self.scratch)
        self.prompt_staging = torch.zeros((4, longest), dtype=torch.long).pin_memory()
        self.prompt_landed = torch.cuda.Event()
        self.prompt_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prompt_outs: dict[int, torch.Tensor] = {}
        self._capture(dev)

    def _step(self, b: int) -> torch.Tensor:
        tok = torch.where(self.inputs[3, :b].bool(), self.greedy[:b], self.inputs[0, :b])
        out = self.model.decode(tok, self.inputs[1, :b], None)
        self.greedy[:b].copy_(out.argmax(dim=-1))
        return out

    def _prompt_step(self, n: int) -> torch.Tensor:
        p = self.prompt
        return self.model.decode(p[0, :n], p[1, :n], p[2, :n], keep=p[3, :1])

    @torch.inference_mode()
    def _capture(self, dev: torch.device) -> None:
        """Each size after an eager run on a side stream (the largest two), the largest first, sharing one pool: only one
        graph runs at a time, and each graph's output stays allocated, so no capture reuses another's."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the first run of a step makes what is made once (cuBLAS's workspace)
            for n in self.prompt_sizes:
                self._prompt_step(n)
            for b in [self.sizes[-1], *self.sizes]:
                self._step(b)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for graphs, outs, step, sizes in ((self.prompt_graphs, self.prompt_outs, self._prompt_step, self.prompt_sizes),
                                          (self.graphs, self.outs, self._step, self.sizes)):
            for size in reversed(sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outs[size] = step(size)
                pool = graph.pool()
                graphs[size] = graph
        for event in (*self.landed, self.prompt_landed):
            event.record()

    def launch(self, slots: list[int], tokens: list[int] | None, positions: list[int], chained: bool = False,
               greedy: bool = True) -> tuple[int, Launch | None]:
        """Start one decode step (row i: tokens[i] at positions[i] in slot slots[i]; `chained`: each slot's
        token is its last step's greedy choice, `tokens` unused).  Returns the graph's size and, with
        `greedy`, the step's Launch."""
        b = next(size for size in self.sizes if size > max(slots))
        n = self.model.slots
        tok, pos, rows, chain = [0] * n, [self.scratch] * n, [0] * n, [0] * n
        for i, (slot, p) in enumerate(zip(slots, positions)):
            pos[slot], rows[i], chain[slot] = p, slot, int(chained)
            if not chained:
                tok[slot] = tokens[i]
        turn, self.turn = self.turn, self.turn ^ 1
        self.landed[turn].synchronize()  # the step before last has read this host buffer and filled that one
        self.staging[turn].copy_(torch.tensor([tok, pos, rows, chain]))
        self.inputs.copy_(self.staging[turn], non_blocking=True)
        self.graphs[b].replay()
        if greedy:
            self.outbox[turn][:b].copy_(self.greedy[:b], non_blocking=True)
        self.landed[turn].record()
        return b, Launch(self.outbox[turn], list(slots), self.landed[turn]) if greedy else None

    def prefills(self, tokens: int) -> bool:
        """Whether a prefill graph takes a chunk of this many prompt tokens."""
        return bool(self.prompt_sizes) and tokens <= self.prompt_sizes[-1]

    def prefill(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        """Prompt tokens start.. of the sequence in `slot` into its KV cache: the last one's logits [1, vocab]
        (float32), from the smallest prefill graph that holds them."""
        n = next(size for size in self.prompt_sizes if size >= len(tokens))
        pad = n - len(tokens)
        self.prompt_landed.synchronize()  # the last prefill has read the host buffer
        self.prompt_staging[:, :n].copy_(torch.tensor([[*tokens, *[0] * pad],
                                                       [*range(start, start + len(tokens)), *[self.scratch] * pad],
                                                       [slot] * n, [len(tokens) - 1] * n]))
        self.prompt.copy_(self.prompt_staging, non_blocking=True)
        self.prompt_graphs[n].replay()
        self.prompt_landed.record()
        return self.prompt_outs[n]

    def run(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step's logits [len(slots), vocab] (row i: tokens[i] at positions[i] in slot slots[i])."""
        b, _ = self.launch(slots, tokens, positions, greedy=False)
        out = self.outs[b]
        return out if slots == list(range(b)) else out.index_select(0, self.inputs[2, : len(slots)])
