"""The KV cache in blocks (paged): a table says which block holds positions c*BLOCK .. c*BLOCK+BLOCK-1 of the
sequence in each slot, and the decode kernel reads chunk c of a row from block table[slot, c].

Each layer's keys (and values) are [rows, kv_heads, cols*BLOCK, hd]: rows of `cols` blocks, block b at row
b // cols, positions (b % cols)*BLOCK.. of it, where cols is a slot's table width (its blocks at max_len, and
one more).  Slot s's "home" is row s: its blocks in order, so a sequence in its home blocks is read in place as
one span of positions (and the first B slots as one strided view, what the CPU's attention takes without a
copy).  The last block of row 0, `scratch`, is no one's: every slot's last table column and every entry no
sequence holds point at it, and a step writes there the rows of slots that are not decoding (a CUDA graph's idle
rows, a prefill graph's padding, a step run ahead for a sequence that has just ended); its position is the last
the table addresses (LlamaForCausalLM.scratch).

By default the cache has a row per slot: every slot owns its home, the table never changes, and nothing is
allocated per sequence.  Given a budget smaller than that (restartkit.reference.runtime.runner:
`--kv-cache-memory`, `--gpu-memory-utilization`), sequences take blocks as they grow (Blocks), their home ones
while they are free, and the scheduler preempts the newest when none is free (restartkit.reference.sched).
"""
from __future__ import annotations

import heapq

import torch

from restartkit.reference.model.config import KV_BLOCK, UnsupportedConfig, cache_positions

BLOCK = KV_BLOCK  # positions a block holds (= kernels.triton_kernels.ATTEND_CHUNK)
STAGE_HALF = 4096  # block ids in each half of the pinned ring that table changes cross to the device from


def columns(max_len: int) -> int:
    """A slot's table columns: blocks for max_len positions, then the scratch column."""
    return cache_positions(max_len) // BLOCK


def rows_for(budget: int, said: str, cfg, tp_size: int, itemsize: int, max_len: int, slots: int) -> int:
    """The rows a KV-cache budget of `budget` bytes holds (`said`: where it came from, for the error), at most a
    row per slot (all that slots can use); refused when it holds not even one (one sequence at max_len)."""
    per_block = 2 * cfg.num_hidden_layers * (cfg.num_key_value_heads // tp_size) * BLOCK * cfg.head_dim * itemsize
    cols = columns(max_len)
    rows = budget // (cols * per_block)
    if rows < 1:
        raise UnsupportedConfig(f"a KV cache of {said} holds {max(budget // per_block, 0)} blocks of {BLOCK} tokens "
                                f"({per_block} bytes each); one sequence of max_model_len {max_len} needs {cols}, the "
                                "spare block included: give it more, or lower --max-model-len")
    return int(min(rows, slots))


class Table:
    """The block table on the device ([slots, cols], read by the kernels and CUDA graphs) and its host copy."""

    def __init__(self, slots: int, cols: int, rows: int, device):
        self.slots, self.cols, self.rows = slots, cols, rows
        self.blocks = rows * cols
        self.scratch = cols - 1
        self.static = rows >= slots  # every slot owns its home row: nothing is allocated
        self.host = [[self.home(s, c) if self.static and c < cols - 1 else self.scratch for c in range(cols)]
                     for s in range(slots)]
        self.device = torch.tensor(self.host, dtype=torch.long, device=device)
        self.away: set[int] = set()  # slots holding a block that is not their home's
        self._stage = None  # the pinned ring the ids cross to the device from (CUDA; Table._staged)

    def home(self, slot: int, col: int) -> int:
        return slot * self.cols + col

    def set(self, slot: int, col: int, ids: list[int]) -> None:
        """Columns col.. of `slot` hold blocks `ids` (scratch: none)."""
        row = self.host[slot]
        row[col:col + len(ids)] = ids
        if self.device.is_cuda:  # from pinned memory, so the copy queues behind the steps in flight
            new = self._staged(ids)
        else:
            new = torch.tensor(ids, dtype=torch.long)
        self.device[slot, col:col + len(ids)].copy_(new, non_blocking=True)
        if any(b not in (self.scratch, self.home(slot, c)) for c, b in enumerate(row[:-1])):
            self.away.add(slot)
        else:
            self.away.discard(slot)

    def _staged(self, ids: list[int]) -> torch.Tensor:
        """`ids` in pinned host memory for an asynchronous copy to the device.  A tensor pinned per call cost
        the scheduler a quarter of its time under 64 clients on an H100 (py-spy): the ids go into a pinned ring
        of two halves instead, and a half is written again only after the copies queued from it have run (the
        event recorded when the ring last left it)."""
        n = len(ids)
        if n > STAGE_HALF:  # more than a half holds (a table of over STAGE_HALF columns): pinned for itself
            return torch.tensor(ids, dtype=torch.long).pin_memory()
        if self._stage is None:
            self._stage = torch.empty(2 * STAGE_HALF, dtype=torch.long, pin_memory=True)
            self._stage_host, self._left, self._at = self._stage.numpy(), [None, None], 0
        half = self._at // STAGE_HALF
        if self._at + n > (half + 1) * STAGE_HALF:
            self._left[half] = torch.cuda.Event()
            self._left[half].record()
            half ^= 1
            if self._left[half] is not None:
                self._left[half].synchronize()  # recorded a whole half of copies ago: done long since
            self._at = half * STAGE_HALF
        at, self._at = self._at, self._at + n
        self._stage_host[at:at + n] = ids
        return self._stage[at:at + n]

    def in_place(self, slots) -> bool:
        """Whether these slots' keys are in their home rows (read as a view of the cache, not gathered)."""
        return max(slots) < self.rows and not self.away.intersection(slots)


class Blocks:
    """Which slot holds which blocks (paged caches only): a sequence takes blocks as it grows, its home ones first
    while they are free, and gives them all back when it leaves or is preempted."""

    def __init__(self, table: Table):
        self.table = table
        self.free = [b for b in range(table.blocks) if b != table.scratch]  # a heap: the lowest free block first
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
            if home in self.free_set:
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


def _blocks_of(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks `ids` [..., n] of a layer's cache: [..., n, kv_heads, BLOCK, hd]."""
    rows, kv, length, hd = cache.shape
    cols = length // BLOCK
    return cache.view(rows, kv, cols, BLOCK, hd)[ids // cols, :, ids % cols]


def slot_keys(cache: torch.Tensor, table: Table, slot: int, span: int) -> torch.Tensor:
    """One slot's first `span` positions of a layer's cache: [kv_heads, span, hd], a view where they are in its
    home row, else gathered."""
    return keys_at(cache, slot_blocks(table, slot, span, cache.device), slot, span)


def slot_blocks(table: Table, slot: int, span: int, device) -> torch.Tensor | None:
    """The blocks holding one slot's first `span` positions, on `device`, for keys_at (the same for every layer);
    None where they are its home row's, in order (read as a view)."""
    n = -(-span // BLOCK)
    ids = table.host[slot][:n]
    if slot < table.rows and ids == [table.home(slot, c) for c in range(n)]:
        return None
    return torch.tensor(ids, device=device)


def keys_at(cache: torch.Tensor, blocks: torch.Tensor | None, slot: int, span: int) -> torch.Tensor:
    """A slot's first `span` positions of a layer's cache [kv_heads, span, hd] by slot_blocks: a view of its home
    row (None), else the blocks gathered."""
    if blocks is None:
        return cache[slot, :, :span]
    got = _blocks_of(cache, blocks)  # [n, kv, BLOCK, hd]
    return got.transpose(0, 1).reshape(cache.shape[1], blocks.shape[0] * BLOCK, cache.shape[-1])[:, :span]


def covering(table: Table, rows: list[int]) -> tuple[int, int] | None:
    """(first, count) of the consecutive slots whose home rows hold every one of `rows`' keys (distinct slots, each
    in its home row), where reading those slots in place costs less than copying the rows' keys: the rows are at
    least half of the slots spanned (a copy reads and writes each row's keys, and the product reads them again).
    None where not."""
    lo, n = min(rows), max(rows) - min(rows) + 1
    if 2 * len(rows) < n or len(set(rows)) != len(rows) or not table.in_place(rows):
        return None
    return lo, n


def row_keys(cache: torch.Tensor, table: Table, rows: torch.Tensor, span: int, in_place: bool) -> torch.Tensor:
    """Each row's slot's first `span` positions, [B, kv_heads, span, hd]: `in_place` (rows are slots 0..B-1, each
    in its home row) a view of the cache; home rows anywhere, a copy of those rows; else gathered by the table."""
    B, kv, hd = rows.shape[0], cache.shape[1], cache.shape[-1]
    if in_place:
        return cache[:B, :, :span]
    if not table.away and table.static:
        return cache[:, :, :span].index_select(0, rows)
    n = -(-span // BLOCK)
    got = _blocks_of(cache, table.device[rows, :n])  # [B, n, kv, BLOCK, hd]
    return got.permute(0, 2, 1, 3, 4).reshape(B, kv, n * BLOCK, hd)[:, :, :span]
