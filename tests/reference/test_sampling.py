"""Sampling on the reference engine is transformers' where transformers has it: each logits processor and
warper (repetition penalty, min new tokens, top-k, top-p, min-p) gives the same scores as transformers'
on the same logits, and greedy decoding with a repetition penalty or min_tokens gives the token ids of
transformers' own `generate`.  OpenAI's presence and frequency penalties follow OpenAI's formula; over
HTTP, stop_token_ids end a choice, ignore_eos and min_tokens keep it going, and seeded sampling repeats."""
import json
import urllib.request

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.generation import logits_process as lp  # noqa: E402

from restartkit.reference.sched.engine import Engine, EngineOptions  # noqa: E402
from restartkit.reference.sched.sequence import Sampling, Sequence, process, warp  # noqa: E402
from tests.hf import checkpoint  # noqa: E402
from tests.helpers import serve_reference  # noqa: E402

VOCAB = 300


def sequence(prompt, tokens, **sampling) -> Sequence:
    seq = Sequence(list(prompt), Sampling(64, **sampling))
    seq.tokens = list(tokens)
    return seq


def ours_vs_theirs(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs[0]))
    finite = ~torch.isinf(ours)
    assert torch.allclose(ours[finite], theirs[0][finite], rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_each_processor_is_transformers_own(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=g) * 3
    prompt, done = [5, 9, 9, 200], [7, 5, 5, 13]
    ids = torch.tensor([prompt + done])
    ours_vs_theirs(process(sequence(prompt, done, repetition_penalty=1.7), logits, frozenset()),
                   lp.RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[None].clone()))
    ours_vs_theirs(process(sequence(prompt, done, min_tokens=6), logits, frozenset({3})),
                   lp.MinNewTokensLengthLogitsProcessor(len(prompt), 6, 3)(ids, logits[None].clone()))
    for kwargs, theirs in (({"top_k": 7}, lp.TopKLogitsWarper(7)), ({"top_p": 0.8}, lp.TopPLogitsWarper(0.8)),
                           ({"min_p": 0.05}, lp.MinPLogitsWarper(0.05))):
        ours_vs_theirs(warp(Sampling(64, temperature=1.0, **kwargs), logits.clone()),
                       theirs(ids, logits[None].clone()))


def test_presence_and_frequency_penalties_are_openai_formula():
    logits = torch.zeros(VOCAB)
    out = process(sequence([1, 2], [4, 4, 4, 6], presence_penalty=0.5, frequency_penalty=0.25), logits, frozenset())
    assert out[4] == -(0.5 + 3 * 0.25) and out[6] == -(0.5 + 0.25) and out[1] == 0 and out[2] == 0  # completion only


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "llama"
    return path, checkpoint(path, rope_theta=10000.0)


@pytest.mark.slow
@pytest.mark.parametrize("ours,theirs", [({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
                                         ({"repetition_penalty": 0.7}, {"repetition_penalty": 0.7})])
def test_greedy_with_a_penalty_is_transformers_generate(hf_model, ours, theirs):
    path, model = hf_model
    eng = Engine(EngineOptions(model=str(path), max_model_len=128, dtype="float32"))
    eng.start()
    changed = 0
    for prompt in ([1, 5, 9, 9, 5], [1, 40, 41], [1, 7]):
        ids = torch.tensor([prompt])
        want = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, **theirs)[0, len(prompt):]
        assert eng.generate(prompt, 16, **ours).tokens == want.tolist()
        changed += want.tolist() != eng.generate(prompt, 16).tokens
    assert changed  # the penalty changed what greedy chose: the comparison above means something


@pytest.mark.slow
def test_min_tokens_is_transformers_min_new_tokens(hf_model):
    path, model = hf_model
    eng = Engine(EngineOptions(model=str(path), max_model_len=128, dtype="float32"))
    eng.start()
    prompt = [1, 5, 9]
    free = eng.generate(prompt, 12).tokens
    eos = free[2]  # as if it were the model's end of sequence: the third greedy token
    eng.config.eos_token_id, eng.config.extra_eos_token_ids = eos, ()
    assert eng.generate(prompt, 12).tokens == free[:3]  # it ends there
    ids = torch.tensor([prompt])
    want = model.generate(ids, max_new_tokens=12, min_new_tokens=8, do_sample=False, pad_token_id=0,
                          eos_token_id=eos)[0, len(prompt):].tolist()
    got = eng.generate(prompt, 12, min_tokens=8).tokens
    assert got == want[:len(got)] and len(got) >= 8 and eos not in got[:8]


@pytest.mark.slow
def test_stop_token_ids_ignore_eos_and_seeded_sampling_over_http(hf_model):
    path, _ = hf_model
    proc, port = serve_reference(path, "--served-model-name", "m")

    def ask(**fields):
        body = json.dumps({"prompt": [1, 5, 9], "max_tokens": 10, "temperature": 0, **fields}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["choices"][0]

    try:
        free = ask()
        stop = free["token_ids"][3]
        cut = ask(stop_token_ids=[stop])
        assert cut["token_ids"] == free["token_ids"][:free["token_ids"].index(stop) + 1]
        assert cut["finish_reason"] == "stop"
        held = ask(stop_token_ids=[stop], min_tokens=10)
        assert len(held["token_ids"]) == 10 and held["finish_reason"] == "length"
        assert ask(ignore_eos=True, max_tokens=10)["finish_reason"] == "length"
        sampled = [ask(temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=7)["token_ids"] for _ in range(2)]
        assert sampled[0] == sampled[1]
        assert ask(repetition_penalty=1.2)["token_ids"] != [] and ask(presence_penalty=1.0, frequency_penalty=1.0)
    finally:
        proc.terminate()
        proc.wait(30)
