"""The reference model is a real model: cached decode equals recomputation,
checkpoints are deterministic and in the Hugging Face layout."""
import json

import torch

from restartkit.reference.checkpoint import shard_files, tensor_shapes, write_checkpoint
from restartkit.reference.engine import Engine, EngineOptions
from restartkit.reference.model import ModelConfig


def test_checkpoint_is_deterministic_and_sharded(tmp_path, tiny_model):
    again = write_checkpoint(tmp_path / "again", "tiny")
    a, b = shard_files(tiny_model), shard_files(again)
    assert len(a) == 2
    assert [x.read_bytes() for x in a] == [x.read_bytes() for x in b]
    index = json.loads((tiny_model / "model.safetensors.index.json").read_text())
    cfg = ModelConfig.load(tiny_model)
    assert set(index["weight_map"]) == {n for n, _ in tensor_shapes(cfg)}
    assert json.loads((tiny_model / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_other_seed_other_weights(tmp_path, tiny_model):
    other = write_checkpoint(tmp_path / "s1", "tiny", seed=1)
    assert shard_files(other)[0].read_bytes() != shard_files(tiny_model)[0].read_bytes()


def test_tokenizer_round_trip(tiny_model):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    text = "Hello, wörld! 123"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[:5] == list(b"Hello")
    assert tok.decode(ids) == text


def test_cached_decode_matches_full_recompute(tiny_model):
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=64))
    eng.start()
    prompt = [256, 10, 20, 30, 40]
    out = eng.generate(prompt, max_tokens=6).tokens
    # recompute: feed prompt + generated tokens in one prefill, take the argmax at each position
    seq = prompt + out
    logits = eng.model(torch.tensor(seq), torch.arange(len(seq)))
    recomputed = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert recomputed == out
    assert set(eng.phases) >= {"weight_load", "kv_cache_alloc", "warmup"}


def test_greedy_is_repeatable_and_seeded_sampling_too(tiny_model):
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=64))
    eng.start()
    p = [256, 1, 2, 3]
    assert eng.generate(p, 8).tokens == eng.generate(p, 8).tokens
    s1 = eng.generate(p, 8, temperature=1.0, seed=7).tokens
    assert s1 == eng.generate(p, 8, temperature=1.0, seed=7).tokens


def test_moe_preset_runs(tmp_path):
    m = write_checkpoint(tmp_path / "moe", "tiny-moe")
    eng = Engine(EngineOptions(model=str(m), max_model_len=32))
    eng.start()
    assert len(eng.generate([256, 5, 6], 4).tokens) == 4
    assert "block_sparse_moe.experts.3.w2.weight" in " ".join(n for n, _ in eng.model.named_parameters())
