"""The reference model is a real model: cached decode equals recomputation,
checkpoints are deterministic and in the Hugging Face layout."""
import json

import pytest

import torch

from restartkit.reference.model.checkpoint import shard_files, tensor_shapes, write_checkpoint
from restartkit.reference.sched.engine import Engine, EngineOptions
from restartkit.reference.model.llama import ModelConfig


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


def test_a_prompt_run_as_rows_of_one_slot_gives_the_prefills_logits(tiny_model):
    """A prefill graph runs a prompt's tokens as decode rows of one slot at consecutive positions, padded with
    rows at the spare position, keeping the last token's logits: the same logits as the prefill, the same KV
    cache, and a chunk after the first reads the keys the first wrote."""
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=64, max_num_seqs=3))
    eng.start()
    m = eng.model
    prompt = [256, 10, 20, 30, 40, 50, 60]
    with torch.inference_mode():
        want = m(torch.tensor(prompt), torch.arange(len(prompt)), 1)[-1]
        cache = m.cache_k[:, 1, :, : len(prompt)].clone()  # slot 1's home row
        m.cache_k.zero_()
        m.cache_v.zero_()
        for chunk, start in ((prompt[:4], 0), (prompt[4:], 4)):
            pad = 16 - len(chunk)
            got = m.decode(torch.tensor(chunk + [0] * pad),
                           torch.tensor([*range(start, start + len(chunk)), *[m.scratch] * pad]),
                           torch.tensor([1] * 16), keep=torch.tensor([len(chunk) - 1]))
    assert got.shape == (1, want.shape[-1])
    assert torch.allclose(got[0], want, atol=1e-5), float((got[0] - want).abs().max())
    assert torch.allclose(m.cache_k[:, 1, :, : len(prompt)], cache, atol=1e-6)
    assert int(got[0].argmax()) == int(want.argmax())


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


def textbook_logits(model, tokens: torch.Tensor, model_dir) -> torch.Tensor:
    """The Hugging Face Llama forward written out plainly (no KV cache, rotate-half with a negation,
    torch's attention with the KV heads repeated, RMSNorm by rsqrt of the mean square), from the
    checkpoint's own tensors (the engine's are fused: q/k/v in one, gate/up in one)."""
    import torch.nn.functional as F

    from restartkit.reference.model.checkpoint import iter_checkpoint
    w = {name: t.float() for name, t in iter_checkpoint(model_dir)}
    cfg = model.config
    hd, T = cfg.head_dim, tokens.shape[0]
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def rms(norm, x):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))

    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    emb = torch.outer(torch.arange(T, dtype=torch.float32), inv).repeat(1, 2)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    x = model.model.embed_tokens.weight[tokens]
    for i, layer in enumerate(model.model.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        h = rms(layer.input_layernorm, x)
        q = rope((h @ w[a + "q_proj.weight"].T).view(T, -1, hd)).transpose(0, 1)
        k = rope((h @ w[a + "k_proj.weight"].T).view(T, -1, hd)).transpose(0, 1).repeat_interleave(group, 0)
        v = (h @ w[a + "v_proj.weight"].T).view(T, -1, hd).transpose(0, 1).repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, -1)
        x = x + o @ w[a + "o_proj.weight"].T
        h = rms(layer.post_attention_layernorm, x)
        up, gate = h @ w[m + "up_proj.weight"].T, h @ w[m + "gate_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[m + "down_proj.weight"].T
    return rms(model.model.norm, x) @ model.lm_head.weight.T


def test_forward_matches_the_textbook_llama(tiny_model):
    """The engine's forward (host rotary tables with the sign folded in, fused RMSNorm, attention
    as two batched matmuls over the masked cache, grouped KV heads) computes the plain Llama."""
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=64, dtype="float32"))
    eng.start()
    seq = [256, 10, 20, 30, 40, 50, 60, 70]
    with torch.inference_mode():
        got = eng.model(torch.tensor(seq), torch.arange(len(seq)))
        want = textbook_logits(eng.model, torch.tensor(seq), tiny_model)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    # and decode step by step over the cache gives the same last row
    with torch.inference_mode():
        eng.model(torch.tensor(seq[:5]), torch.arange(5))
        for i in range(5, len(seq)):
            row = eng.model(torch.tensor([seq[i]]), torch.tensor([i]))[0]
    assert torch.allclose(row, want[-1], atol=1e-4, rtol=1e-4)


def test_model_create_makes_the_parent_directories(tmp_path):
    from tests.helpers import run_cli
    out = tmp_path / "a" / "b" / "tiny"
    r = run_cli("model", "create", "--preset", "tiny", "--out", out)
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").exists() and not list(out.parent.glob("*.partial-*"))


def test_processed_weights_fuse_qkv_and_gate_up_per_rank(tiny_model, tmp_path):
    """Each rank's qkv_proj is its q, k and v slices stacked in that order (gate_up_proj: gate, up); int8
    quantizes the fused rows one scale each; a checkpoint missing a part is refused naming the fused tensor."""
    from safetensors.torch import load_file, save_file

    from restartkit.reference.model.checkpoint import iter_checkpoint
    from restartkit.reference.model.llama import Parallel
    from restartkit.reference.model.weights import processed_weights
    cfg = ModelConfig.load(tiny_model)
    ckpt = dict(iter_checkpoint(tiny_model))
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    for rank in (0, 1):
        got = dict(processed_weights(str(tiny_model), cfg, Parallel(2, rank), torch.float32, "none", "cpu"))
        assert not any(k.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight")) for k in got)
        parts = [ckpt[a + p + ".weight"].chunk(2, dim=0)[rank] for p in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(got[a + "qkv_proj.weight"], torch.cat(parts))
        parts = [ckpt[m + p + ".weight"].chunk(2, dim=0)[rank] for p in ("gate_proj", "up_proj")]
        assert torch.equal(got[m + "gate_up_proj.weight"], torch.cat(parts))
    q8 = dict(processed_weights(str(tiny_model), cfg, Parallel(), torch.float32, "int8", "cpu"))
    assert q8[a + "qkv_proj.weight"].dtype == torch.int8
    assert q8[a + "qkv_proj.weight_scale"].shape == (q8[a + "qkv_proj.weight"].shape[0], 1)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: t for k, t in load_file(f).items() if k != a + "v_proj.weight"}
            save_file(tensors, broken / f.name, metadata={"format": "pt"})
        elif f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    index = broken / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].pop(a + "v_proj.weight", None)
        index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks part of model.layers.1.self_attn.qkv_proj.weight"):
        list(processed_weights(str(broken), cfg, Parallel(), torch.float32, "none", "cpu"))


def test_the_processed_layout_is_named_in_the_weight_cache_fingerprint(tiny_model):
    """A weight cache built before q/k/v and gate/up were fused holds tensors this engine has no place for: the
    fingerprint's layout field tells them apart by name (the engine loads from disk, saying why)."""
    from restartkit.weightcache.fingerprint import CHECKPOINT, REFERENCE_LAYOUT, differences, fingerprint
    fp = fingerprint(str(tiny_model), dtype="float32")
    assert fp["layout"] == REFERENCE_LAYOUT
    older = {k: v for k, v in fp.items() if k != "layout"}
    assert [d["field"] for d in differences(older, fp)] == ["layout"]
    assert fingerprint(str(tiny_model), dtype=CHECKPOINT)["layout"] == CHECKPOINT


def test_a_sampled_answer_continued_from_its_own_prefix_goes_on_the_same(tiny_model):
    """Each sampled token's randomness is (seed, position) alone: a request resumed from the prompt plus the first
    k tokens it was given (on another engine, after a crash) draws the rest of the same answer; another seed
    draws another answer."""
    from restartkit.reference.sched.sequence import token_seed
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=64))
    eng.start()
    p = [256, 1, 2, 3]
    whole = eng.generate(p, 16, temperature=1.0, seed=7).tokens
    for k in (1, 5, 11):
        assert eng.generate(p + whole[:k], 16 - k, temperature=1.0, seed=7).tokens == whole[k:], k
    assert eng.generate(p, 16, temperature=1.0, seed=8).tokens != whole
    assert len({token_seed(s, pos) for s in range(64) for pos in range(64)}) == 64 * 64
