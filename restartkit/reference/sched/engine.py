"""The reference engine: the model runner (restartkit.reference.runtime.runner) with the scheduler that owns
its steps.  The serving surface submits to the scheduler; the scheduler runs the runner's forward passes; the
runner runs the model.  Without a scheduler (the warm-up, tests, the ranks after 0 of a tensor-parallel
group) `generate` runs one sequence in the calling thread.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from restartkit.reference.runtime.runner import (CMD_DECODE, CMD_DROP_KV, CMD_EXIT, CMD_MIXED, CMD_PREFILL,
                                                 CMD_RESTORE_KV, CMD_SPECULATE, CMD_TABLE, EngineNotReady,
                                                 EngineOptions, ModelRunner)
from restartkit.reference.sched.scheduler import Scheduler, run_alone
from restartkit.reference.sched.sequence import Sampling, Sequence
from restartkit.reference.sched.speculative import speculate

__all__ = ["Completion", "Engine", "EngineNotReady", "EngineOptions"]


@dataclass
class Completion:
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str
    top_logprobs: list[dict[int, float]] | None = None  # per token: the k likeliest ids and their logprobs


@dataclass
class Engine(ModelRunner):
    scheduler: Scheduler | None = None  # once serving: what runs this engine's steps

    @property
    def serving(self) -> bool:
        return self.scheduler is not None

    def generate(self, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 want_logprobs: bool = False, top_logprobs: int = 0, **sampling) -> Completion:
        """One completion, in a batch of its own: through the scheduler once it runs, else in this thread
        (tests, scripts); `sampling`: the rest of sched.sequence.Sampling (top_p, penalties, ...)."""
        self.check_prompt(prompt, max_tokens)
        seq = Sequence(list(prompt), Sampling(max_tokens, temperature, seed, want_logprobs, top_logprobs, **sampling),
                       isolated=True, quiet=True)
        if self.scheduler is not None:
            self.scheduler.submit([seq])
        else:
            with self.lock:
                run_alone(self, seq)
        tokens, lps, tops, finish = [], [], [], "length"
        while True:
            ev = seq.events.get()
            if ev.kind == "error":
                raise ev.error
            if ev.kind == "done":
                finish = ev.finish
                break
            tokens.append(ev.token)
            lps.append(ev.logprob)
            tops.append(ev.top)
        return Completion(list(prompt), tokens, lps if want_logprobs else None, finish, tops if top_logprobs else None)

    def speculate(self, seq: Sequence) -> None:
        """Greedy decoding of `seq` with the draft model proposing (restartkit.reference.sched.speculative)."""
        if self.leads:
            self._broadcast(CMD_SPECULATE, [seq.sampling.max_tokens, seq.slot], seq.prompt)
        speculate(self, seq)

    def worker_loop(self) -> None:
        """Ranks > 0: run what rank 0 broadcasts, until told to exit."""
        import torch.distributed as dist
        group = getattr(self, "_control", None)
        while True:
            header = torch.zeros(6, dtype=torch.long)
            dist.broadcast(header, src=0, group=group)
            cmd, n, a, b, _, _ = header.tolist()
            payload = torch.zeros(n, dtype=torch.long)
            if n:
                dist.broadcast(payload, src=0, group=group)
            data = payload.tolist()
            if cmd == CMD_EXIT:
                return
            if cmd == CMD_PREFILL:
                self.prefill(a, data, b)
            elif cmd == CMD_DECODE:
                self.decode(data[:a], data[a:2 * a], data[2 * a:])
            elif cmd == CMD_MIXED:  # a segments: slots, first positions, lengths, then every token
                lens, at, segments = data[2 * a:3 * a], 3 * a, []
                for slot, p0, n in zip(data[:a], data[a:2 * a], lens):
                    segments.append((slot, p0, data[at:at + n]))
                    at += n
                self.mixed(segments)
            elif cmd == CMD_SPECULATE:  # the same greedy steps as rank 0, its tokens kept here
                seq = Sequence(data, Sampling(a))
                seq.slot = b
                self.speculate(seq)
            elif cmd == CMD_TABLE:  # slot a's columns b.. hold these blocks
                self.model.kv.set(a, b, data)
            elif cmd == CMD_DROP_KV:
                self._drop_kv_locked()
            elif cmd == CMD_RESTORE_KV:
                self._restore_kv_locked()

    def shutdown_workers(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.options.tp_size > 1 and self.options.tp_rank == 0:
            with self.lock:
                self._broadcast(CMD_EXIT)
