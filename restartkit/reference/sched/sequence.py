"""One sequence the scheduler runs: a prompt, how to choose each next token, where its tokens go.

A request of p prompts with n choices each is p x n sequences; the HTTP surface reads their
events (Event) from one queue and never touches a tensor.  Choosing a token is here too: the
logits of one row, the sampling parameters, and the randomness of each sampled token: a function of the
request's seed and the token's position alone (token_seed), not a stream, so that a sequence continued from a
prefix of its own answer (a request resumed on another engine) draws what it would have drawn.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Sampling:
    """How a sequence chooses its next token (temperature 0: greedy), with OpenAI's and vLLM's names.
    Processed in transformers' order: repetition penalty (prompt and completion) and OpenAI's presence and
    frequency penalties (completion), EOS held back until min_tokens; then temperature, top_k, top_p, min_p."""
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the model's own logits, ending at its EOS: what speculative decoding computes."""
        return self.temperature == 0 and not self.penalised and not (
            self.min_tokens or self.stop_token_ids or self.ignore_eos)

    @property
    def argmax(self) -> bool:
        """Each token is the argmax of the model's own logits (which the device can take where the logits are):
        greedy, no penalty, nothing held back, no logprobs.  Stop tokens and ignore_eos say only where it ends."""
        return self.temperature == 0 and not self.penalised and not self.min_tokens and not (
            self.logprobs or self.top_logprobs)


@dataclass
class Event:
    """What the scheduler tells the reader of a sequence: a token (with its logprob and top logprobs when
    asked; `eos`: the end-of-sequence token, the last), the end (`finish`: stop or length), or an error."""
    index: int
    kind: str  # "token", "done" or "error"
    token: int = -1
    logprob: float | None = None
    top: dict | None = None
    eos: bool = False
    finish: str = ""
    error: BaseException | None = None
    at: float = 0.0  # time.perf_counter() when the scheduler emitted it


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    sampling: Sampling
    index: int = 0  # its choice's index in the request
    events: "queue.SimpleQueue[Event]" = field(default_factory=queue.SimpleQueue)
    isolated: bool = False  # runs in a batch of its own: the canary, speculative decoding
    quiet: bool = False  # its reader wants the whole answer only: tokens are handed over at the end (emit)
    # the scheduler's, below
    slot: int = -1
    prefilled: int = 0  # tokens of its context in the KV cache
    tokens: list[int] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    shared: bool = False  # it ran in a step beside another sequence
    held: list = field(default_factory=list)  # a quiet sequence's token events not handed over yet

    resume: list[int] | None = None  # preempted: what its KV cache is rebuilt from (the prompt, its tokens but the last)

    @property
    def context(self) -> list[int]:
        """What its prefill puts in the KV cache: its prompt; after a preemption, its prompt and tokens but the
        last, which it decodes next (so its tokens go on as if it had never left)."""
        return self.prompt if self.resume is None else self.resume

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.context)

    @property
    def position(self) -> int:
        """Where its next decode step writes: the position of its last token."""
        return len(self.prompt) + len(self.tokens) - 1

    def cancel(self) -> None:
        """Its reader is gone or has all it wants: the scheduler drops it before its next step."""
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        """Hand an event to the sequence's reader.  A quiet sequence's tokens are held and handed over with
        the event after them (its "done" or "error"): a reader that needs only the whole answer is not woken
        at every step (8 such readers woken at every step cost the batch a tenth of its speed)."""
        event.index, event.at = self.index, time.perf_counter()
        if self.quiet and event.kind == "token":
            self.held.append(event)
            return
        for held in self.held:
            self.events.put(held)
        self.held.clear()
        self.events.put(event)


def stops(seq: Sequence, eos_ids) -> frozenset:
    """The tokens that end `seq` now: its stop_token_ids and (unless ignore_eos) the model's EOS ids; none
    before min_tokens."""
    s = seq.sampling
    if len(seq.tokens) < s.min_tokens:
        return frozenset()
    return frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else frozenset(eos_ids))


MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: every bit of `x` moves every bit of the result."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, position: int) -> int:
    """The seed of the draw for the token at `position` of a sequence sampled with `seed`: (seed, position) alone
    decide it (distinct choices of one request have distinct seeds, restartkit.reference.serving)."""
    return _mix(_mix((seed + 0x9E3779B97F4A7C15) & MASK64) ^ position) & ((1 << 63) - 1)


def choose(seq: Sequence, logits32: torch.Tensor, default_seed: int,
           eos_ids=frozenset()) -> tuple[int, float | None, dict | None]:
    """The next token of `seq` from its row of float32 host logits; with its logprob and the k likeliest
    tokens' when asked (else None), both of the model's own distribution (before any processing)."""
    s = seq.sampling
    scores = process(seq, logits32, eos_ids)
    if s.temperature > 0:
        position = len(seq.prompt) + len(seq.tokens)  # of the token chosen now
        g = torch.Generator().manual_seed(token_seed(s.seed if s.seed is not None else default_seed, position))
        probs = torch.softmax(warp(s, scores / s.temperature), dim=-1)
        token = int(torch.multinomial(probs, 1, generator=g))
    else:
        token = int(torch.argmax(scores))
    if not s.logprobs and not s.top_logprobs:
        return token, None, None
    logp = torch.log_softmax(logits32, dim=-1)
    top = None
    if s.top_logprobs:
        vals, ids = torch.topk(logp, min(s.top_logprobs, logp.shape[-1]))
        top = {int(i): float(v) for i, v in zip(ids, vals)}
    return token, float(logp[token]), top


def process(seq: Sequence, logits32: torch.Tensor, eos_ids) -> torch.Tensor:
    """Penalties and min_tokens on one row of logits (a new tensor where anything applies)."""
    s = seq.sampling
    held = len(seq.tokens) < s.min_tokens and (s.stop_token_ids or (eos_ids and not s.ignore_eos))
    if not s.penalised and not held:
        return logits32
    scores = logits32.clone()
    if s.repetition_penalty != 1.0:  # transformers' RepetitionPenaltyLogitsProcessor, over prompt and completion
        seen = torch.tensor(sorted(set(seq.prompt) | set(seq.tokens)), dtype=torch.long)
        picked = scores[seen]
        scores[seen] = torch.where(picked < 0, picked * s.repetition_penalty, picked / s.repetition_penalty)
    if (s.presence_penalty or s.frequency_penalty) and seq.tokens:  # OpenAI's, over the completion
        ids, counts = torch.tensor(seq.tokens, dtype=torch.long).unique(return_counts=True)
        scores[ids] -= s.frequency_penalty * counts.float() + s.presence_penalty
    if held:  # transformers' MinNewTokensLengthLogitsProcessor: no end before min_tokens
        ends = list(s.stop_token_ids) + ([] if s.ignore_eos else list(eos_ids))
        scores[torch.tensor(ends, dtype=torch.long)] = float("-inf")
    return scores


def warp(s: Sampling, scores: torch.Tensor) -> torch.Tensor:
    """top_k, top_p, min_p on temperature-scaled scores, as transformers' warpers (each keeps at least one)."""
    filtered = float("-inf")
    if s.top_k > 0 and s.top_k < scores.shape[-1]:
        kth = torch.topk(scores, s.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, filtered)
    if s.top_p < 1.0:
        ordered, idx = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - s.top_p)
        remove[-1] = False
        scores = scores.masked_fill(remove.scatter(0, idx, remove), filtered)
    if s.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        remove = probs < s.min_p * probs.max()
        scores = scores.masked_fill(remove, filtered)
    return scores
