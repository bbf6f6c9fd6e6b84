"""The scheduler: one object between the HTTP surface and the model, deciding step by step which
sequences join, run and leave (continuous batching).

Each step, under the engine's lock:
  - sequences whose reader cancelled them leave (a client gone, a stop string met);
  - waiting sequences join while a KV-cache slot is free (max_num_seqs slots);
  - every sequence past its prefill decodes one token and, in the same forward pass, joining sequences'
    prompts are prefilled in chunks, oldest first, up to the step's token budget (max_batched_tokens, counting
    the decode rows): several short prompts prefill together, and a long one takes several steps, so a running
    stream waits one step's budget at most, never a whole prompt's prefill.  A prompt's last chunk yields its
    first token.  A step with decode rows only runs the runner's decode (its CUDA graphs); a step with one chunk
    and no decode rows the runner's prefill (a graph where one takes the chunk);
  - sequences that met their end-of-sequence token or their max_tokens leave, freeing their slot.

Where the KV cache is paged (restartkit.reference.model.paged: a budget smaller than every slot at max_len), a
sequence joins when blocks for its prompt are free, and each step takes the blocks its rows write into.  When a
decode row finds none free, the newest running sequence is preempted: it gives back its blocks and slot, and waits
at the head of the queue; when it joins again its prompt and tokens so far are prefilled (recompute), and it
decodes on from its last token, its answer the same as if it had never left.  A prompt chunk that finds no
block free waits for a later step.

When every running sequence takes the argmax (Sampling.argmax) and nothing waits to join, the next step
is launched before this one's tokens are read, where the engine's launch does not wait (decode graphs): it
takes each sequence's token on the device, and the host emits this step's tokens while the device computes
the next, so the host's part of a step is hidden.  A sequence that ends at this step's token (EOS, a stop
token or string, its client gone) has one step computed in vain, whose key and value land past its end in a
slot free by then; a sequence that ends by max_tokens at this step is not run ahead.

Isolated sequences (restartkit's canary, speculative decoding) run in a batch of their own: a
greedy token can depend on the batch it was computed in (a matrix product's summation order
changes with its row count), and the canary must compare like with like across restarts.

Admin work that needs the engine to itself (sleep, a KV-cache drop before a snapshot, a weight
release) goes through the scheduler's `exclusive()`: no sequence joins, the running ones finish, the work runs.
"""
from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from contextlib import contextmanager

from restartkit.reference.model.paged import BLOCK
from restartkit.reference.sched.sequence import Event, Sequence, choose, stops

MAX_BATCHED_TOKENS = 512  # tokens a step runs by default: decode rows and prompt chunks (vLLM's max_num_batched_tokens)
HOLD_S = 30.0  # how long waiting sequences wait for weights or a KV cache let go (a snapshot, sleep)


class Overloaded(RuntimeError):
    """The waiting queue is full: a 503 with Retry-After."""


class EngineGone(RuntimeError):
    """The engine holds no weights or KV cache (asleep, dropped for a snapshot): a 503."""


class Scheduler:
    short_chunks_as_prefills = False  # see step(): off until it keeps greedy answers equal on a GPU

    def __init__(self, runner, max_num_seqs: int, max_waiting: int, max_batched_tokens: int = MAX_BATCHED_TOKENS):
        self.runner = runner  # the model runner (restartkit.reference.runtime.runner) whose steps this runs
        self.max_num_seqs, self.max_waiting, self.max_batched_tokens = max_num_seqs, max_waiting, max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs))  # a heap: a sequence takes the lowest free slot
        self.cond = threading.Condition()
        self.paused = 0  # exclusive() holders waiting or working
        self.unservable_since: float | None = None  # since when the waiting sequences wait for the engine
        self.stopped = False
        # isolated: sequences that ran in a batch of their own to the end; shared_isolated: ones that did not;
        # ahead: greedy steps launched before the last one's tokens were read
        # mixed: steps that ran decode rows and prompt chunks (or several chunks) in one forward pass
        self.counts = {"steps": 0, "decode_rows": 0, "prefill_tokens": 0, "finished": 0, "cancelled": 0,
                       "isolated": 0, "shared_isolated": 0, "ahead": 0, "mixed": 0, "preempted": 0}
        self._thread: threading.Thread | None = None
        self._ahead: tuple[list[Sequence], object] | None = None  # sequences and the step launched ahead for them
        # where launches do not wait (runs_ahead): a step's events go to their readers once the next step is
        # launched (_hand_over), so that the readers' threads wake while the device computes, not while the host builds
        # and launches the next step; [(sequence, event)] of this step, and of the step before (held)
        self._outbox: list[tuple[Sequence, Event]] = []
        self._held: list[tuple[Sequence, Event]] = []

    # ---- the HTTP surface's side ------------------------------------------------------------
    def submit(self, seqs: list[Sequence], first: bool = False) -> None:
        """Queue a request's sequences, all or none (Overloaded when they do not fit the waiting queue);
        `first`: ahead of the queue and past its limit (restartkit's canary: a backlog of clients must not make
        it discard a good engine)."""
        with self.cond:
            if not first and len(self.waiting) + len(seqs) > self.max_waiting:
                raise Overloaded(f"{len(self.waiting)} sequences are waiting (max {self.max_waiting}); "
                                 "retry shortly")
            if first:
                self.waiting.extendleft(reversed(seqs))
            else:
                self.waiting.extend(seqs)
            self.cond.notify_all()

    @property
    def depth(self) -> tuple[int, int]:
        """(running, waiting) sequences."""
        return len(self.running), len(self.waiting)

    @contextmanager
    def exclusive(self):
        """The engine to itself: nothing joins, the running sequences finish, then the body runs under
        the engine's lock.  Sequences still waiting join afterwards (or fail, if the body took the
        engine's weights or KV cache away)."""
        with self.cond:
            self.paused += 1
            self.cond.notify_all()
            while self.running:
                self.cond.wait()
        try:
            with self.runner.lock:
                yield
        finally:
            with self.cond:
                self.paused -= 1
                self.cond.notify_all()

    # ---- admin work: the runner's memory, with the engine to itself --------------------------
    def drop_kv_cache(self) -> int:
        with self.exclusive():
            return self.runner.drop_kv_cache()

    def restore_kv_cache(self) -> None:
        with self.exclusive():
            self.runner.restore_kv_cache()

    def release_weights(self) -> dict:
        with self.exclusive():
            return self.runner.release_weights()

    def reattach_weights(self, fallback: bool = False) -> dict:
        with self.exclusive():
            return self.runner.reattach_weights(fallback=fallback)

    # ---- the loop ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(5)

    def run(self) -> None:
        while self._work_to_do():
            try:
                with self.runner.lock:
                    self.step()
            except Exception as e:  # a failed step fails the sequences in it, never the loop
                self._fail_running(e)

    def _work_to_do(self) -> bool:
        """Wait until there is something to run; False once stopped."""
        with self.cond:
            while not self.stopped and not self._admit() and not self.running:
                # waiting for an engine that let go of its weights: look again (it says nothing when they are back)
                self.cond.wait(0.05 if self.unservable_since is not None and self.waiting else None)
            return not self.stopped

    def _admit(self) -> bool:
        """Move waiting sequences into free slots (called under cond); True when anything runs."""
        if not self.waiting:
            self.unservable_since = None
        while self.waiting and self.free_slots and not self.paused:
            head = self.waiting[0]
            if head.cancelled.is_set():
                self.waiting.popleft()
                self._finish(head, "cancelled")
                continue
            if self.running and (head.isolated or self.running[0].isolated):
                break  # an isolated sequence waits for an empty batch, and keeps it to itself
            if not self.runner.can_serve():
                self._hold_or_fail()
                break
            self.unservable_since = None
            free = self.runner.free_blocks()
            if free is not None and free < -(-len(head.context) // BLOCK) + len(self.running):
                break  # too few KV-cache blocks for its prompt (and one to grow for each running sequence)
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self.free_slots)  # the lowest: one stream runs the one-row decode graph
            self.running.append(seq)
        return bool(self.running)

    def _hold_or_fail(self) -> None:
        """The engine let go of its weights or KV cache (a snapshot, sleep): the waiting sequences wait for
        them to come back, for HOLD_S at most, then fail (a 503)."""
        now = time.monotonic()
        if self.unservable_since is None:
            self.unservable_since = now
        if now - self.unservable_since < HOLD_S:
            return
        self._hand_over(everything=True)  # a preempted sequence's tokens before its error
        while self.waiting:
            seq = self.waiting.popleft()
            seq.emit(Event(0, "error", error=EngineGone("the engine holds no weights or KV cache")))
            seq.finished = True
        self.unservable_since = None

    def step(self) -> None:
        """One step (see the module's docstring), under the engine's lock.  The last step's events are handed to
        their readers once this one is launched, or at its end where it launches nothing; all of them where the
        batch is empty after it (nothing would launch)."""
        self._held, self._outbox = self._held + self._outbox, []
        try:
            self._step()
        finally:
            self._hand_over()
            if not self.running or not self.runner.runs_ahead:
                self._hand_over(everything=True)

    def _emit(self, seq: Sequence, event: Event) -> None:
        self._outbox.append((seq, event))

    def _hand_over(self, everything: bool = False) -> None:
        """The held events (the last step's) to their readers; with `everything`, this step's too."""
        held, self._held = self._held, []
        if everything:
            held, self._outbox = held + self._outbox, []
        for seq, event in held:
            seq.emit(event)

    def _step(self) -> None:
        for seq in [s for s in self.running if s.cancelled.is_set()]:
            self._leave(seq, "cancelled")
        if not self.running:
            return
        if not self.runner.can_serve():
            raise EngineGone("the engine holds no weights or KV cache")
        self.counts["steps"] += 1
        if len(self.running) > 1:
            for seq in self.running:
                seq.shared = True
        if self.running[0].isolated and self.runner.draft is not None and self.running[0].sampling.plain_greedy:
            seq = self.running[0]  # speculative decoding: the draft and this model, the whole sequence at once
            self.runner.reserve(seq.slot, len(seq.prompt) + seq.sampling.max_tokens)  # alone: every block is free
            self.runner.speculate(seq)
            self._leave(seq, None)
            return
        joining = [s for s in self.running if s.prefilling]
        # in slot order: the first B slots are read in place where the decode step is eager (the CPU)
        decoding = sorted((s for s in self.running if not s.prefilling), key=lambda s: s.slot)
        if not self._room(decoding):
            return  # one was preempted: the step starts over
        if not joining:
            self._decode(decoding)
            return
        if self._ahead is not None:  # the step run ahead was for the batch before these joined: its tokens first
            self._collect_ahead()
            decoding = [s for s in decoding if s in self.running]
        chunks = [c for c in self._chunks(joining, self.max_batched_tokens - len(decoding))
                  if self.runner.reserve(c[0].slot, c[2])]  # a chunk with no block free waits
        if not decoding and not chunks:
            self._preempt(self.running[-1])  # prompts whose blocks are all taken: the newest lets go of its own
            return
        if not decoding and len(chunks) == 1:
            self._prefill_chunk(*chunks[0])
        elif self.short_chunks_as_prefills and 0 < len(chunks) <= 2 and all(
                self.runner.graphed_prefill(end - start) for _, start, end in chunks):
            # short prompts through their prefill graphs, then the decode graph: on an H200 at 8B shapes an eager
            # mixed step takes about 19 ms of host time, more than three graphs' replays (docs/BENCHMARKS.md).  Off:
            # on an H100 in float32 it made greedy answers differ from their answers alone (gpu_paged_check)
            for chunk in chunks:
                self._prefill_chunk(*chunk)
            if live := [s for s in decoding if s in self.running]:  # two prompts and no stream: no decode step
                self._decode(live)
        else:
            self._mixed(decoding, chunks)

    def _room(self, decoding: list[Sequence]) -> bool:
        """KV-cache blocks for each decode row's position, the oldest sequences' first; where none is free the
        newest running sequence is preempted (the step run ahead read first) and False returned."""
        if self.runner.free_blocks() is None:
            return True  # every slot has its own blocks
        age = {s: i for i, s in enumerate(self.running)}
        for seq in sorted(decoding, key=age.__getitem__):
            if not self.runner.reserve(seq.slot, seq.position + 1):
                if self._ahead is not None:
                    self._collect_ahead()
                if self.running:
                    self._preempt(self.running[-1])
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """`seq` gives back its KV-cache blocks and slot and waits at the head of the queue, to be prefilled again
        from its prompt and tokens (see the module's docstring)."""
        self.running.remove(seq)
        self.runner.release(seq.slot)
        heapq.heappush(self.free_slots, seq.slot)
        seq.slot, seq.prefilled = -1, 0
        seq.resume = seq.prompt + seq.tokens[:-1] if seq.tokens else None
        self.counts["preempted"] += 1
        with self.cond:
            self.waiting.appendleft(seq)

    @staticmethod
    def _chunks(joining: list[Sequence], budget: int) -> list[tuple[Sequence, int, int]]:
        """(sequence, start, end) of the prompt chunks this step prefills: oldest first, `budget` tokens in all
        (one at least).  A prompt of several tokens is not cut into a chunk of one where it can be helped (a step
        runs a one-token segment as a decode row, by another attention kernel than a chunk's on a GPU, and bf16
        rounds the two differently): the cut moves a token earlier, or the chunk waits for the next step."""
        out, budget = [], max(1, budget)
        for seq in joining:
            if budget <= 0:
                break
            left = len(seq.context) - seq.prefilled
            n = min(left, budget)
            if n == 1 < left or left - n == 1:
                if n > 2:
                    n -= 1
                elif out:
                    break
            out.append((seq, seq.prefilled, seq.prefilled + n))
            budget -= n
        return out

    def _prefill_chunk(self, seq: Sequence, start: int, end: int) -> None:
        logits = self.runner.prefill(seq.slot, seq.context[start:end], start)
        self._hand_over()
        seq.prefilled = end
        self.counts["prefill_tokens"] += end - start
        if not seq.prefilling and not self._resumed(seq):  # its first token, from the prompt's last position
            self._take(seq, logits[-1].float().cpu())

    @staticmethod
    def _resumed(seq: Sequence) -> bool:
        """Whether a prefill that just ended was a preempted sequence's (its next token is known: it decodes on)."""
        if seq.resume is None:
            return False
        seq.resume = None
        return True

    def _mixed(self, decoding: list[Sequence], chunks: list[tuple[Sequence, int, int]]) -> None:
        """Decode rows and prompt chunks in one forward pass; each decode row takes its token, and each prompt
        whose last chunk ran its first (greedy ones by the argmax where the logits are)."""
        segments = [(s.slot, s.position, [s.tokens[-1]]) for s in decoding]
        segments += [(seq.slot, start, seq.context[start:end]) for seq, start, end in chunks]
        logits = self.runner.mixed(segments)
        self._hand_over()  # (launched: the step before's events go while the device computes this one)
        self.counts["mixed"] += 1
        self.counts["decode_rows"] += len(decoding)
        for seq, start, end in chunks:
            seq.prefilled = end
            self.counts["prefill_tokens"] += end - start
        takers = [*enumerate(decoding), *((len(decoding) + j, seq) for j, (seq, _, _) in enumerate(chunks)
                                          if not seq.prefilling and not self._resumed(seq))]
        greedy = logits.argmax(dim=-1).tolist() if any(seq.sampling.argmax for _, seq in takers) else None
        for i, seq in takers:
            if seq.sampling.argmax:
                self._took(seq, greedy[i], None, None)
            else:
                self._take(seq, logits[i].float().cpu())

    def _decode(self, seqs: list[Sequence]) -> None:
        args = [s.slot for s in seqs], [s.tokens[-1] for s in seqs], [s.position for s in seqs]
        self.counts["decode_rows"] += len(seqs)
        if all(s.sampling.argmax for s in seqs):
            self._decode_greedy(seqs, *args)
            return
        if self._ahead is not None:
            self._collect_ahead()
            seqs = [s for s in seqs if s in self.running]
            if not seqs:
                return
            args = [s.slot for s in seqs], [s.tokens[-1] for s in seqs], [s.position for s in seqs]
        rows = self.runner.decode(*args)
        self._hand_over()
        rows = rows.float().cpu()
        for i, seq in enumerate(seqs):
            self._take(seq, rows[i])

    def _decode_greedy(self, seqs: list[Sequence], slots: list[int], tokens: list[int], positions: list[int]) -> None:
        """Greedy tokens, the argmax taken where the logits are; this step is the one launched ahead at the
        last step when there was one, and the next one is launched ahead when it may be."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not set(seqs) <= set(ahead[0]):
            self._ahead = ahead
            self._collect_ahead()
            seqs = [s for s in seqs if s in self.running]
            if seqs:
                self._decode_greedy(seqs, [s.slot for s in seqs], [s.tokens[-1] for s in seqs],
                                    [s.position for s in seqs])
            return
        step = ahead[1] if ahead is not None else self.runner.launch_greedy(slots, tokens, positions)
        if self._may_run_ahead(seqs):
            self._ahead = seqs, self.runner.launch_greedy(slots, None, [p + 1 for p in positions], chained=True)
            self.counts["ahead"] += 1
        self._hand_over()
        for seq, token in zip(seqs, step.tokens(slots)):
            self._took(seq, token, None, None)

    def _may_run_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether the next step may start before this one's tokens are read: the engine's launch does not
        wait, nothing waits for a free slot, and no sequence ends by max_tokens at this step's token."""
        return (self.runner.runs_ahead and not (self.waiting and self.free_slots)
                and all(len(s.tokens) + 1 < s.sampling.max_tokens and not s.cancelled.is_set() for s in seqs)
                and all(self.runner.reserve(s.slot, s.position + 2) for s in seqs))  # the block it writes into

    def _collect_ahead(self) -> None:
        """The step launched ahead, read: each of its sequences still running takes its token."""
        seqs, step = self._ahead
        self._ahead = None
        live = [s for s in seqs if s in self.running]
        for seq, token in zip(live, step.tokens([s.slot for s in live])):
            self._took(seq, token, None, None)

    def _drop_ahead(self) -> None:
        """No sequence is left for the step launched ahead: wait for it (the engine may be handed to an
        exclusive() holder next) and forget it."""
        if self._ahead is not None:
            step, self._ahead = self._ahead[1], None
            step.wait()

    def _take(self, seq: Sequence, row) -> None:
        token, logprob, top = choose(seq, row, self.runner.options.seed, self.runner.config.eos_token_ids)
        self._took(seq, token, logprob, top)

    def _took(self, seq: Sequence, token: int, logprob, top) -> None:
        eos = token in stops(seq, self.runner.config.eos_token_ids)
        seq.tokens.append(token)
        self._emit(seq, Event(0, "token", token, logprob, top, eos=eos))
        if eos:
            self._leave(seq, "stop")
        elif len(seq.tokens) >= seq.sampling.max_tokens:
            self._leave(seq, "length")

    def _leave(self, seq: Sequence, finish: str | None) -> None:
        """`finish` None: it finished and said so itself (speculative decoding)."""
        if seq in self.running:
            self.running.remove(seq)
            self.runner.release(seq.slot)
            heapq.heappush(self.free_slots, seq.slot)
            if not self.running:
                self._drop_ahead()
        self._finish(seq, finish)
        with self.cond:
            self.cond.notify_all()  # an exclusive() waiting for the batch to empty

    def _finish(self, seq: Sequence, finish: str | None) -> None:
        if seq.isolated:
            self.counts["shared_isolated" if seq.shared else "isolated"] += 1
        if finish == "cancelled":
            self.counts["cancelled"] += 1
        else:
            self.counts["finished"] += 1
            if finish is not None:
                self._emit(seq, Event(0, "done", finish=finish))
        seq.finished = True

    def _fail_running(self, error: Exception) -> None:
        self._ahead = None  # a failed step's successor is not waited for: it may fail the same way
        self._hand_over(everything=True)  # the tokens before the error
        for seq in list(self.running):
            seq.emit(Event(0, "error", error=error))
            self._leave(seq, "cancelled")


def run_alone(runner, seq: Sequence) -> None:
    """Run one sequence to its end in this thread, in slot 0 (no scheduler is running: the warm-up)."""
    run_together(runner, [seq])


def run_together(runner, seqs: list[Sequence], max_batched_tokens: int = MAX_BATCHED_TOKENS) -> dict:
    """Run `seqs` to their ends in this thread, a slot each, their steps as a serving scheduler would run them
    (no scheduler is running: the warm-up, tests, scripts); returns the scheduler's counts."""
    sched = Scheduler(runner, len(seqs), len(seqs), max_batched_tokens)
    sched.waiting.extend(seqs)
    while sched.waiting or sched.running:
        sched._admit()  # each takes the lowest free slot; a preempted one joins again here
        sched.step()
    return sched.counts
