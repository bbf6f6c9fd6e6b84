"""Speculative decoding in the reference engine: a draft model proposes tokens, the
model checks them in one forward pass; the output is the model's own greedy output
whatever the draft proposes."""
import json
import shutil

import pytest

from restartkit.reference.model.checkpoint import write_checkpoint
from restartkit.reference.sched.engine import Engine, EngineOptions
from tests.helpers import run_cli

PROMPTS = [[256, 10, 20, 30, 40], [256, 1], [256, 99, 98, 97, 96, 95, 94, 93, 92]]


def _engine(model, **kw) -> Engine:
    eng = Engine(EngineOptions(model=str(model), max_model_len=96, **kw))
    eng.start()
    return eng


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("draft") / "tiny-s7", "tiny", seed=7)


@pytest.mark.parametrize("draft_is_model", [True, False], ids=["draft-agrees", "draft-disagrees"])
@pytest.mark.parametrize("k", [1, 4])
def test_speculative_greedy_output_is_the_models_own(tiny_model, other_draft, draft_is_model, k):
    plain = _engine(tiny_model)
    spec = _engine(tiny_model)
    spec.draft, spec.spec_tokens = _engine(tiny_model if draft_is_model else other_draft), k
    for prompt in PROMPTS:
        for max_tokens in (1, 2, 7, 40):
            want = plain.generate(prompt, max_tokens, want_logprobs=True)
            got = spec.generate(prompt, max_tokens, want_logprobs=True)
            assert got.tokens == want.tokens, (prompt, max_tokens)
            assert got.finish_reason == want.finish_reason
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    c = spec.spec_counts
    assert c["rounds"] > 0 and c["proposed"] >= c["accepted"]
    if draft_is_model:  # a draft that is the model itself is always right
        assert c["accepted"] == c["proposed"]
    else:
        assert c["accepted"] < c["proposed"]


def test_sampling_does_not_use_the_draft(tiny_model, other_draft):
    spec = _engine(tiny_model)
    spec.draft = _engine(other_draft)
    plain = _engine(tiny_model)
    p = [256, 1, 2, 3]
    assert spec.generate(p, 8, temperature=1.0, seed=3).tokens == plain.generate(p, 8, temperature=1.0, seed=3).tokens
    assert spec.spec_counts["rounds"] == 0


def test_a_draft_with_another_tokenizer_is_refused_before_anything_starts(make_policy, tmp_path, tiny_model):
    bad = tmp_path / "other-vocab"
    shutil.copytree(tiny_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "vocab_size": 999}))
    policy = make_policy(service_extra=f'draft_model = "{bad}"\n')
    r = run_cli("start", "--policy", policy)
    assert r.returncode != 0
    assert "vocab_size is 999" in r.stderr and "[service] draft_model" in r.stderr, r.stderr
    assert run_cli("status", "--policy", policy).returncode != 0  # nothing was started
