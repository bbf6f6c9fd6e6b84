#!/usr/bin/env python3
"""The reference engine against transformers on this machine's GPU (or the CPU), for the checkpoint
configs tests/reference/test_fidelity.py covers on the CPU in CI:

    python3 scripts/gpu_fidelity.py [--device cuda] [--dtype float32|bfloat16]

Each config: a checkpoint transformers writes (random weights), transformers' greedy `generate` on the
device, the reference engine on the device (CUDA-graph decode on a GPU), the token ids compared for
every prompt.  In bfloat16 the two implementations round differently, so a mismatch is counted only
where transformers' own top two logits were apart by more than --tie-margin.  Prints a verdict table.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def compare(path: Path, model, device: str, dtype: str, margin: float) -> tuple[int, int, list[str]]:
    """(prompts equal, prompts, notes)."""
    import torch
    from tokenizers import Tokenizer
    import transformers

    from restartkit.reference.serving.protocol import encode_prompt
    from restartkit.reference.sched.engine import Engine, EngineOptions
    from tests.reference.test_fidelity import NEW_TOKENS, PROMPTS
    tdtype = getattr(torch, dtype)
    model = model.to(device=device, dtype=tdtype)
    eng = Engine(EngineOptions(model=str(path), device=device, max_model_len=128, dtype=dtype))
    eng.start()
    tok, hf_tok = Tokenizer.from_file(str(path / "tokenizer.json")), transformers.AutoTokenizer.from_pretrained(path)
    same, notes = 0, []
    for p in PROMPTS:
        ids = hf_tok(p, return_tensors="pt").input_ids.to(device)
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
        want = out.sequences[0, ids.shape[1]:].tolist()
        mine = encode_prompt(tok, p)
        got = eng.generate(mine, NEW_TOKENS).tokens
        if mine != ids[0].tolist():
            notes.append(f"{p!r}: prompt ids differ")
        elif got == want:
            same += 1
        else:
            i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            top2 = out.scores[i][0].float().topk(2).values if i < len(out.scores) else None
            gap = float(top2[0] - top2[1]) if top2 is not None else float("inf")
            if gap <= margin:
                same += 1
                notes.append(f"{p!r}: token {i} differs at a near tie (top-2 gap {gap:.4f})")
            else:
                notes.append(f"{p!r}: token {i} differs (top-2 gap {gap:.4f}): {got} vs {want}")
    return same, len(PROMPTS), notes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tie-margin", type=float, default=0.0)
    a = ap.parse_args()
    from tests.hf import checkpoint
    from tests.reference.test_fidelity import CASES
    rows, t0 = [], time.monotonic()
    for case, cfg in CASES.items():
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "ckpt"
            model = checkpoint(path, **cfg)
            try:
                same, n, notes = compare(path, model, a.device, a.dtype, a.tie_margin)
            except Exception as e:  # a case that cannot run is a FAIL with its reason, not a crash of the run
                same, n, notes = 0, 1, [f"{type(e).__name__}: {e}"]
        rows.append((case, same, n, notes))
    print(f"\nreference engine vs transformers ({a.device}, {a.dtype}, {time.strftime('%Y-%m-%d %H:%M %Z')}, "
          f"{time.monotonic() - t0:.0f} s)")
    for case, same, n, notes in rows:
        print(f"  {'ok  ' if same == n else 'FAIL'} {case}: {same}/{n} prompts token-identical")
        for note in notes:
            print(f"         {note}")
    return 0 if all(same == n for _, same, n, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
