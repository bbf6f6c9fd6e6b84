"""The KV cache in blocks (paged): each layer's keys and values are [kv_heads, blocks, BLOCK, head_dim], and a
table says which block holds positions c*BLOCK .. c*BLOCK+BLOCK-1 of the sequence in each slot.

A block is the decode kernel's chunk of keys (64 positions), so the kernel reads chunk c of a row from block
table[slot, c]; the CPU reads a row's keys in place where its blocks are its slot's own run (below), else gathers
them.  Block 0 is the scratch block: a slot's last table column is always 0, and its position (`scratch`, the
last the table addresses) is where a step writes the rows of slots that are not decoding (a CUDA graph's idle
rows, a prefill graph's padding); a table entry no sequence holds is 0 too, so a write there lands in scratch.

By default the cache holds every slot at max_len: slot s owns blocks 1 + s*(cols-1) .. (its "home"), the table
never changes, and nothing is allocated per sequence (the layout of a cache of one span per slot).  Given a
smaller budget, or more slots than the budget holds at max_len (restartkit.reference.runtime.runner: the
`--kv-cache-memory` and `--gpu-memory-utilization` flags), sequences take blocks as they grow (Blocks) and the
scheduler preempts the newest when none is free (restartkit.reference.sched.scheduler).  A sequence takes its
home blocks while they are free, so a slot's keys stay one run and are read in place.
"""
from __future__ import annotations

import heapq

import torch

from restartkit.reference.model.config import KV_BLOCK, cache_positions

BLOCK = KV_BLOCK  # positions a block holds (= kernels.triton_kernels.ATTEND_CHUNK)


def columns(max_len: int) -> int:
    """A slot's table columns: blocks for max_len positions, then the scratch column."""
    return cache_positions(max_len) // BLOCK


def home_blocks(slots: int, cols: int) -> int:
    """Blocks for every slot at max_len: the scratch block, then each slot's run."""
    return 1 + slots * (cols - 1)


class Table:
    """The block table on the device ([slots, cols], read by the kernels and CUDA graphs) and its host copy."""

    def __init__(self, slots: int, cols: int, blocks: int, device):
        self.slots, self.cols, self.blocks = slots, cols, blocks
        self.static = blocks >= home_blocks(slots, cols)  # every slot owns its home: nothing is allocated
        self.host = [[self.home(s, c) if self.static and c < cols - 1 else 0 for c in range(cols)]
                     for s in range(slots)]
        self.device = torch.tensor(self.host, dtype=torch.long, device=device)
        self.away: set[int] = set()  # slots holding a block that is not their home's

    def home(self, slot: int, col: int) -> int:
        return 1 + slot * (self.cols - 1) + col

    def set(self, slot: int, col: int, ids: list[int]) -> None:
        """Columns col.. of `slot` hold blocks `ids` (0: none)."""
        row = self.host[slot]
        row[col:col + len(ids)] = ids
        new = torch.tensor(ids, dtype=torch.long)
        if self.device.is_cuda:  # pinned, so the copy queues behind the steps in flight instead of waiting for them
            new = new.pin_memory()
        self.device[slot, col:col + len(ids)].copy_(new, non_blocking=True)
        if any(b not in (0, self.home(slot, c)) for c, b in enumerate(row[:-1])):
            self.away.add(slot)
        else:
            self.away.discard(slot)

    def in_place(self, slots) -> bool:
        """Whether these slots' keys are their home runs (read as a view of the cache, not gathered)."""
        return home_blocks(max(slots) + 1, self.cols) <= self.blocks and not self.away.intersection(slots)

    def span(self, slot: int, n: int) -> list[int]:
        """The blocks of `slot`'s first n columns."""
        return self.host[slot][:n]


class Blocks:
    """Which slot holds which blocks (paged caches only): a sequence takes blocks as it grows, its home ones first
    while they are free, and gives them all back when it leaves or is preempted."""

    def __init__(self, table: Table):
        self.table = table
        self.free = list(range(1, table.blocks))  # a heap: the lowest free block first
        self.free_set = set(self.free)
        self.held: dict[int, list[int]] = {}

    @property
    def available(self) -> int:
        return len(self.free_set)

    def reserve(self, slot: int, upto: int) -> list[int] | None:
        """Blocks for positions [0, upto) of `slot`: the ones it newly takes (to be written into the table), or
        None when too few are free (then it takes none)."""
        have = self.held.setdefault(slot, [])
        need = -(-upto // BLOCK) - len(have)
        if need <= 0:
            return []
        if need > len(self.free_set):
            return None
        got = []
        for c in range(len(have), len(have) + need):
            home = self.table.home(slot, c)
            if home in self.free_set and home < self.table.blocks:
                self.free_set.discard(home)  # left in the heap: skipped when popped
            else:
                home = self._pop()
            got.append(home)
        have += got
        return got

    def _pop(self) -> int:
        while True:
            b = heapq.heappop(self.free)
            if b in self.free_set:
                self.free_set.discard(b)
                return b

    def release(self, slot: int) -> int:
        """All of `slot`'s blocks back; how many it held."""
        have = self.held.pop(slot, [])
        for b in have:
            self.free_set.add(b)
            heapq.heappush(self.free, b)
        if len(self.free) > 4 * len(self.free_set) + 64:  # homes taken leave stale heap entries: rebuild
            self.free = sorted(self.free_set)
        return len(have)


def slot_keys(cache: torch.Tensor, table: Table, slot: int, span: int) -> torch.Tensor:
    """One slot's first `span` positions of a layer's cache [kv_heads, blocks, BLOCK, hd]: [kv_heads, span, hd], a
    view where its blocks are consecutive, else gathered."""
    n = -(-span // BLOCK)
    ids = table.span(slot, n)
    kv, hd = cache.shape[0], cache.shape[-1]
    if ids == list(range(ids[0], ids[0] + n)):
        keys = cache[:, ids[0]:ids[0] + n]
    else:
        keys = cache.index_select(1, torch.tensor(ids, device=cache.device))
    return keys.reshape(kv, n * BLOCK, hd)[:, :span]


def row_keys(cache: torch.Tensor, table: Table, rows: torch.Tensor, span: int, in_place: bool) -> torch.Tensor:
    """Each row's slot's first `span` positions, [B, kv_heads, span, hd]: `in_place` (rows are slots 0..B-1, each
    in its home run) a strided view of the cache, else gathered by the table."""
    B, kv, hd = rows.shape[0], cache.shape[0], cache.shape[-1]
    per = table.cols - 1
    if in_place:
        return cache[:, 1:1 + B * per].reshape(kv, B, per * BLOCK, hd).transpose(0, 1)[:, :, :span]
    n = -(-span // BLOCK)
    keys = cache[:, table.device[rows, :n]]  # [kv, B, n, BLOCK, hd]
    return keys.transpose(0, 1).reshape(B, kv, n * BLOCK, hd)[:, :, :span]
