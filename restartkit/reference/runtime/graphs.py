"""CUDA graphs of the decode step, one for each batch size the engine keeps.

A graph of one decode step runs over the first B KV-cache slots: row b is slot b, its token and position read
from static inputs; a slot not decoding among them writes at its spare position (LlamaForCausalLM.scratch).
The engine keeps a graph for each power of two below its slot count and one for the slot count itself (8
slots: 1, 2, 4, 8), all in one memory pool, and a step runs the smallest that holds its highest slot; the
scheduler gives each sequence the lowest free slot, so one stream runs the one-row graph.

What this buys, measured on an H200 at 8B shapes (docs/BENCHMARKS.md): a step over one row 4.83-4.90 ms against
4.97-5.09 ms over eight, with the attention kernel that stops at each row's position (0.15 ms; 1 ms when attention
read every position); more where max_num_seqs is larger (not measured).  What it costs: capturing four graphs took
0.17-0.23 s against about 0.06 s for one, paid at a start and at a KV-cache restore; and a prompt's greedy tokens
could depend on the batch size its step ran at (a matrix product's kernel is chosen by its row count: on the H200
the one-row and eight-row graphs gave bit-identical logits), which is one reason restartkit's canary runs in a
batch of its own (restartkit.reference.sched).
"""
from __future__ import annotations

import torch


def graph_sizes(slots: int) -> list[int]:
    """The batch sizes the engine captures: powers of two below `slots`, and `slots`."""
    sizes, b = [], 1
    while b < slots:
        sizes.append(b)
        b *= 2
    return [*sizes, slots]


class DecodeGraphs:
    """The captured decode steps of one model.  A graph copies its inputs from pinned host memory (tokens,
    positions and the rows wanted, of every slot) and its greedy tokens back to pinned host memory itself,
    so a step is one graph launch and one wait (which lets other Python threads run)."""

    def __init__(self, model, dev: torch.device):
        self.model, self.scratch = model, model.scratch
        self.sizes = graph_sizes(model.slots)
        self.host = torch.zeros((3, model.slots), dtype=torch.long).pin_memory()  # tokens, positions, rows
        self.host[1].fill_(self.scratch)
        self.inputs = self.host.to(dev)
        self.greedy_host = torch.zeros(model.slots, dtype=torch.long).pin_memory()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outs: dict[int, torch.Tensor] = {}
        self.done = torch.cuda.Event()
        self._capture(dev)

    @torch.inference_mode()
    def _capture(self, dev: torch.device) -> None:
        """Each size after an eager run on a side stream (the largest two), the largest first, sharing one pool: only one
        graph runs at a time, and each graph's output stays allocated, so no capture reuses another's."""
        tok, pos = self.inputs[0], self.inputs[1]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the first run of a step makes what is made once (cuBLAS's workspace)
            for b in [self.sizes[-1], *self.sizes]:
                self.model.decode(tok[:b], pos[:b], None)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.inputs.copy_(self.host, non_blocking=True)
                self.outs[b] = self.model.decode(tok[:b], pos[:b], None)
                self.greedy_host[:b].copy_(self.outs[b].argmax(dim=-1), non_blocking=True)
            pool = graph.pool()
            self.graphs[b] = graph
        self.done.record()

    def run(self, slots: list[int], tokens: list[int], positions: list[int], greedy: bool = False):
        """One decode step (row i: tokens[i] at positions[i] in slot slots[i]): the logits [len(slots), vocab],
        or with `greedy` each row's likeliest token (a list)."""
        b = next(size for size in self.sizes if size > max(slots))
        tok, pos, rows = [0] * b, [self.scratch] * b, [0] * b
        for i, (slot, t, p) in enumerate(zip(slots, tokens, positions)):
            tok[slot], pos[slot], rows[i] = t, p, slot
        self.done.synchronize()  # the last replay has read the host buffer
        self.host[:, :b].copy_(torch.tensor([tok, pos, rows]))
        self.graphs[b].replay()
        self.done.record()
        if greedy:
            self.done.synchronize()
            chosen = self.greedy_host.tolist()
            return [chosen[slot] for slot in slots]
        out = self.outs[b]
        return out if slots == list(range(b)) else out.index_select(0, self.inputs[2, : len(slots)])
