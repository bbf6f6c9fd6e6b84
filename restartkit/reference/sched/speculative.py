"""Speculative decoding on the reference engine: greedy decoding of one sequence with a draft model proposing up
to spec_tokens tokens a round, which the engine's model checks in one forward pass."""
from __future__ import annotations

import torch

from restartkit.reference.sched.sequence import Event, choose


@torch.inference_mode()
def speculate(engine, seq) -> None:
    """Greedy decoding of one sequence (restartkit.reference.sched.sequence) with the draft proposing
    up to spec_tokens tokens a round, which this model checks in one forward pass: every token emitted
    is this model's own greedy choice (the draft only decides how many come out of one pass).  The
    draft runs in its single slot; this model in the sequence's."""
    dev, draft, eos, slot = engine.device, engine.draft, engine.config.eos_token_ids, seq.slot
    prompt, max_tokens, out = seq.prompt, seq.sampling.max_tokens, seq.tokens

    def take(row: torch.Tensor) -> int:  # this model's greedy choice from one row of logits
        token, logprob, top = choose(seq, row.float().cpu(), engine.options.seed)
        out.append(token)
        seq.emit(Event(0, "token", token, logprob, top, eos=token in eos))
        return token

    def done() -> bool:
        return len(out) >= max_tokens or out[-1] in eos

    take(engine.model(torch.tensor(prompt, device=dev), torch.arange(len(prompt)).to(dev), slot)[-1])
    drafted = 0  # how much of the sequence the draft's KV cache holds
    while not done():
        seen = prompt + out
        pos = len(seen) - 1  # the last token's position: in neither cache yet
        k = min(engine.spec_tokens, max_tokens - len(out))
        # the draft catches up on what it has not seen (through the last token), then proposes k
        logits = draft.model(torch.tensor(seen[drafted:], device=dev), torch.arange(drafted, pos + 1).to(dev))[-1]
        props = [int(torch.argmax(logits))]
        for j in range(1, k):
            logits = draft.model(torch.tensor([props[-1]], device=dev), torch.tensor([pos + j], device=dev))[0]
            props.append(int(torch.argmax(logits)))
        # row j: this model's logits after the last token and the first j proposals
        rows = engine.model(torch.tensor([seen[-1], *props], device=dev), torch.arange(pos, pos + k + 1).to(dev), slot)
        j = 0  # proposals accepted
        while take(rows[j]) == (props[j] if j < k else None):
            j += 1
            if done():
                break
        drafted = pos + 1 + min(j, k - 1)  # the proposals it was fed and that were kept
        engine.spec_counts["rounds"] += 1
        engine.spec_counts["proposed"] += k
        engine.spec_counts["accepted"] += j
    seq.emit(Event(0, "done", finish="stop" if out[-1] in eos else "length"))
