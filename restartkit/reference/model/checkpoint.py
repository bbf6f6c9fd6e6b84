"""Checkpoints in the Hugging Face Llama layout, written and read.

`write_checkpoint` makes deterministic seeded random weights: each tensor's
generator is seeded from (seed, tensor name), so any shard can be rebuilt
alone and two runs give the same bytes.  Files: config.json,
generation_config.json, model-0000i-of-0000n.safetensors,
model.safetensors.index.json, tokenizer.json, tokenizer_config.json.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from restartkit.errors import UsageError
from restartkit.reference.model.layout import INDEX, shard_files  # noqa: F401  (torch-free, re-exported)
from restartkit.reference.model.llama import ModelConfig, init_std

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Every preset can chat (the openai client's chat calls, vLLM's /v1/chat/completions): a plain role-tagged
# template, rendered alike by the reference engine, transformers and vLLM.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclass(frozen=True)
class Preset:
    config: ModelConfig
    max_shard_bytes: int
    about: str


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    torch_dtype="float32"),
        max_shard_bytes=400_000,
        about="0.2 M parameters, float32; CPU tests and the demo",
    ),
    "tiny-moe": Preset(
        ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    num_local_experts=4, num_experts_per_tok=2, torch_dtype="float32"),
        max_shard_bytes=400_000,
        about="tiny with a 4-expert top-2 MoE MLP; expert-parallel tests",
    ),
    "small": Preset(
        ModelConfig(vocab_size=384, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                    torch_dtype="float32"),
        max_shard_bytes=20_000_000,
        about="13 M parameters, float32 (53 MB); CPU memory checks (sleep)",
    ),
    "1b": Preset(
        ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                    torch_dtype="bfloat16"),
        max_shard_bytes=2 * 10**9,
        about="Llama-3.2-1B shapes, about 2.5 GB in bfloat16",
    ),
    "8b-shape": Preset(
        ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                    torch_dtype="bfloat16"),
        max_shard_bytes=5 * 10**9,
        about="Llama-3-8B shapes, about 16 GB in bfloat16; GPU benchmarks",
    ),
    "14b-shape": Preset(
        ModelConfig(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                    num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=8192,
                    torch_dtype="bfloat16"),
        max_shard_bytes=5 * 10**9,
        about="14B shapes (48 layers of 5120, a 152k vocabulary), about 29.5 GB in bfloat16; size-independence benchmarks",
    ),
    "24b-shape": Preset(
        ModelConfig(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                    num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=8192,
                    torch_dtype="bfloat16"),
        max_shard_bytes=5 * 10**9,
        about="24B shapes (40 layers of 5120, MLP 32768), about 48 GB in bfloat16: 3 x 8b-shape, for size independence",
    ),
}


def tensor_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in the order Hugging Face writes them."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (cfg.num_attention_heads * hd, h)),
            (p + "self_attn.k_proj.weight", (cfg.num_key_value_heads * hd, h)),
            (p + "self_attn.v_proj.weight", (cfg.num_key_value_heads * hd, h)),
            (p + "self_attn.o_proj.weight", (h, cfg.num_attention_heads * hd)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if cfg.is_moe:
            out.append((p + "block_sparse_moe.gate.weight", (cfg.num_local_experts, h)))
            for e in range(cfg.num_local_experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                out += [(q + "w1.weight", (i, h)), (q + "w2.weight", (h, i)), (q + "w3.weight", (i, h))]
        else:
            out += [
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab_size, h))]
    return out


def seeded_tensor(cfg: ModelConfig, name: str, shape, seed: int, dtype, device) -> torch.Tensor:
    std = init_std(cfg, name)
    if std == 0.0:  # norms start at one, as in a trained-from-scratch model
        return torch.ones(shape, dtype=dtype, device=device)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    t = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
    return t.mul_(std).to(dtype)


def plan_shards(named_shapes, itemsize: int, max_shard_bytes: int) -> list[list[tuple[str, tuple]]]:
    shards, current, size = [], [], 0
    for name, shape in named_shapes:
        nbytes = itemsize * _numel(shape)
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_checkpoint(out: str | Path, preset: str, seed: int = 0, dtype: str | None = None,
                     device: str = "cpu", progress: Callable[[str], None] | None = None) -> Path:
    """Write a seeded random checkpoint; refuses a non-empty directory."""
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}", hint=f"choose one of: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    cfg = ModelConfig(**{**p.config.__dict__})
    if dtype:
        if dtype not in DTYPES:
            raise UsageError(f"unknown dtype {dtype!r}", hint=f"choose one of: {', '.join(DTYPES)}")
        cfg.torch_dtype = dtype
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty", hint="pick a new --out directory or remove this one")
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    torch_dtype = DTYPES[cfg.torch_dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shards = plan_shards(tensor_shapes(cfg), itemsize, p.max_shard_bytes)
    weight_map, total = {}, 0
    t0 = time.monotonic()
    for idx, shard in enumerate(shards, 1):
        fname = f"model-{idx:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: seeded_tensor(cfg, name, shape, seed, torch_dtype, device).cpu() for name, shape in shard}
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        os.chmod(tmp / fname, 0o666 & ~umask)  # safetensors writes 0600: a checkpoint is read by the engine's user
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        if progress:
            progress(f"shard {idx}/{len(shards)} written ({total / 1e9:.2f} GB, {time.monotonic() - t0:.1f} s)")
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf = cfg.to_hf()
    hf["restartkit"] = {"preset": preset, "seed": seed}
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False}, indent=2))
    write_tokenizer(tmp, cfg)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet that GPT-2-style tokenizers use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def write_tokenizer(out: Path, cfg: ModelConfig) -> None:
    """A byte-level tokenizer: byte b is token b, then the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Ids past the specials (the embedding is larger, as in Llama 3) decode to "".
    tok.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    assert tok.token_to_id(BOS) == cfg.bos_token_id and tok.token_to_id(EOS) == cfg.eos_token_id
    # BOS first, as Llama 3's tokenizer does: an engine (or transformers) encoding with special tokens adds it
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, cfg.bos_token_id)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "model_max_length": cfg.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))


# ---- reading ------------------------------------------------------------------

def iter_checkpoint(model_dir: str | Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    for path in shard_files(model_dir):
        tensors = load_file(str(path), device=device)
        if device == "cpu":
            # load_file maps the file copy-on-write: a page not yet copied would change under a
            # running engine when someone writes the file in place.  The engine's weights are its own.
            tensors = {name: t.clone() for name, t in tensors.items()}
        yield from tensors.items()


def checkpoint_bytes(model_dir: str | Path) -> int:
    return sum(p.stat().st_size for p in shard_files(model_dir))
