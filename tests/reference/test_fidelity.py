"""The reference engine computes what transformers computes, for checkpoints transformers wrote
(random weights, several Llama configs): greedy token ids equal transformers' own `generate` for
several prompts, on the CPU, alone and in a batch whose prompts prefill in chunks of a 3-token budget.  The
canary compares the engine with itself across a restart; this compares it with the model's reference
implementation.  A config whose math the engine does not
implement is refused at load, naming the key."""
import json

import pytest

transformers = pytest.importorskip("transformers")

from restartkit.reference.sched.engine import Engine, EngineOptions  # noqa: E402
from restartkit.reference.model.llama import ModelConfig, UnsupportedConfig  # noqa: E402
from restartkit.reference.sched.scheduler import run_together  # noqa: E402
from restartkit.reference.sched.sequence import Sampling, Sequence  # noqa: E402
from tests.hf import checkpoint  # noqa: E402

PROMPTS = ["The quick brown fox", "Restarting an inference server", "a"]
NEW_TOKENS = 12

def reference_ids(model, path) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return out


def engine_ids(path) -> list[list[int]]:
    from tokenizers import Tokenizer
    from restartkit.reference.serving.protocol import encode_prompt
    eng = Engine(EngineOptions(model=str(path), max_model_len=128, dtype="float32"))
    eng.start()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    out = []
    for p in PROMPTS:
        ids = encode_prompt(tok, p)
        out.append((ids, eng.generate(ids, NEW_TOKENS).tokens))
    # all together at a budget of 3 tokens a step: prompts cut into chunks beside the others' decode rows
    together = [Sequence(ids, Sampling(NEW_TOKENS)) for ids, _ in out]
    run_together(eng, together, 3)
    assert [s.tokens for s in together] == [t for _, t in out], "chunked in a batch, the answers differ from alone"
    return out


CASES = {
    "transformers 5 rope_parameters, theta 10000": dict(rope_theta=10000.0),
    "transformers 4 layout, theta 10000": dict(rope_theta=10000.0, as_v4=True),
    "Llama 3.1 rope scaling (llama3)": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "Llama 3.1 rope scaling, transformers 4 layout": dict(rope_theta=500000.0, as_v4=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "linear rope scaling": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "dynamic rope scaling": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "yarn rope scaling": dict(rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 64}),
    "tied embeddings (Llama 3.2 small)": dict(tie_word_embeddings=True),
    "no BOS in the tokenizer": dict(bos=False),
    "head_dim apart from hidden / heads, rms_norm_eps": dict(head_dim=32, rms_norm_eps=0.1),
    "MoE (Mixtral)": dict(moe=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_ids_equal_transformers(tmp_path, case):
    path = tmp_path / "ckpt"
    model = checkpoint(path, **CASES[case])
    want, got = reference_ids(model, path), engine_ids(path)
    assert [p for p, _ in got] == [p for p, _ in want], "the prompt's token ids differ (BOS?)"
    assert got == want, json.dumps({"transformers": want, "reference engine": got})


REFUSED = {
    "attention_bias": (dict(attention_bias=True), "config.json attention_bias"),
    "mlp_bias": (dict(mlp_bias=True), "config.json mlp_bias"),
    "hidden_act": (dict(hidden_act="gelu"), "config.json hidden_act: 'gelu'"),
    "longrope": (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                                    "original_max_position_embeddings": 64}), "rope_type 'longrope'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_config_whose_math_is_not_implemented_is_refused_naming_the_key(tmp_path, case):
    cfg, words = REFUSED[case]
    path = tmp_path / "ckpt"
    checkpoint(path, **cfg)
    with pytest.raises(UnsupportedConfig, match=words.replace("(", r"\(")):
        Engine(EngineOptions(model=str(path), max_model_len=64, dtype="float32")).start()
    from restartkit.reference.model.layout import model_dir_ok
    assert words in model_dir_ok(str(path))  # said before anything starts (plan, policy check, start)


def test_an_unknown_key_is_refused_and_dynamic_rope_only_within_its_length(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint(path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "qk_layernorm": True}))
    with pytest.raises(UnsupportedConfig, match="config.json qk_layernorm: is not a key the reference engine knows"):
        ModelConfig.load(path)
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedConfig, match="rope_type 'dynamic' past max_position_embeddings"):
        Engine(EngineOptions(model=str(path), max_model_len=512, dtype="float32")).start()


def test_end_of_sequence_ids_from_the_generation_config_end_a_completion(tmp_path):
    """A list of EOS ids (as Llama 3 instruct models ship): the engine stops at any of them, as generate does."""
    path = tmp_path / "ckpt"
    model = checkpoint(path)
    want = reference_ids(model, path)
    stop_at = want[0][1][3]  # the 4th token of the first prompt's completion ends it now
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [257, stop_at]}))
    model.generation_config.eos_token_id = [257, stop_at]
    want, got = reference_ids(model, path), engine_ids(path)
    assert got == want and got[0][1][-1] == stop_at and len(got[0][1]) <= 4


@pytest.mark.slow
def test_served_through_the_openai_client_the_answers_are_transformers_before_and_after_a_restart(
        make_policy, service_cleanup, tmp_path, sockdir, preloads):
    """The new user's path: a transformers 5 checkpoint restartkit did not write (rope_parameters, tied
    embeddings, a tokenizer that adds no BOS), started by `restartkit start`, asked through the openai client:
    transformers' answers, and the same after a cold restart and an ipc restart (the weight cache holds the
    embedding only: the tied output projection is the same tensor), each with its canary identical."""
    import functools
    openai = pytest.importorskip("openai")
    from tests.helpers import run_cli
    from tests.helpers import ipc_policy, start_preload
    path = tmp_path / "their-llama"
    model = checkpoint(path, rope_theta=10000.0, tie_word_embeddings=True, bos=False)
    want = [ids for _, ids in reference_ids(model, path)]
    policy = ipc_policy(functools.partial(make_policy, model=str(path)), sockdir)
    policy.write_text(policy.read_text().replace('engine_args = ["--threads", "1"]',
                                                 'engine_args = ["--threads", "1", "--dtype", "float32"]'))
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    port = int(policy.read_text().split("port = ")[1].split()[0])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

    def answers():
        return [client.completions.create(model="their-llama", prompt=p, max_tokens=NEW_TOKENS, temperature=0)
                .choices[0].model_extra["token_ids"] for p in PROMPTS]
    assert answers() == want
    start_preload(policy, preloads)
    for strategy in ("cold", "ipc"):
        r = run_cli("restart", "--policy", policy, "--strategy", strategy, "--strict", "--json")
        rec = json.loads(r.stdout)
        assert r.returncode == 0 and rec["served_by"] == strategy and rec["proof"]["canary_identical"] is True, rec
        assert answers() == want
