"""A Hugging Face Llama (or Mixtral) config.json read the way transformers 4 and 5 write it, without
torch (the CLI checks a checkpoint's config before anything starts).  What would change the math and is
not implemented by the reference engine is refused here, naming the key; nothing is dropped silently."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


KV_BLOCK = 64  # positions a KV-cache block holds (restartkit.reference.model.paged)


def cache_positions(max_len: int) -> int:
    """Positions a KV-cache slot's block table addresses: max_len rounded up to whole blocks, then a block for the
    spare position, the last (restartkit.reference.model.paged: where rows nobody reads are written)."""
    return (-(-max_len // KV_BLOCK) + 1) * KV_BLOCK

class UnsupportedConfig(ValueError):
    """A config.json key whose math the reference engine does not implement: refused, never dropped."""


class InvalidConfig(UnsupportedConfig):
    """A config.json value no model can have (NaN, a negative size, an id outside the vocabulary): refused
    before anything is allocated, naming the key and the value."""


# (low, high) for every size the model reads: high is far past any real model, low what the math needs
INT_RANGES = {"vocab_size": (2, 10_000_000), "hidden_size": (1, 1_000_000), "intermediate_size": (1, 10_000_000),
              "num_hidden_layers": (1, 10_000), "num_attention_heads": (1, 100_000),
              "num_key_value_heads": (1, 100_000), "max_position_embeddings": (1, 100_000_000),
              "head_dim": (1, 100_000), "num_local_experts": (0, 100_000), "num_experts_per_tok": (1, 100_000)}
DTYPE_NAMES = ("float32", "bfloat16", "float16")


# config.json keys that change nothing the reference engine computes at inference (training knobs, metadata,
# generation defaults a server does not apply: restartkit's canary and clients say what they want)
INERT_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "initializer_range", "use_cache",
    "pad_token_id", "attention_dropout", "pretraining_tp", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "restartkit", "id2label", "label2id", "tokenizer_class", "prefix", "problem_type",
    "task_specific_params", "finetuning_task", "return_dict", "output_attentions", "output_hidden_states",
    "torchscript", "use_bfloat16", "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "tie_encoder_decoder", "cross_attention_hidden_size", "decoder_start_token_id",
    "sep_token_id", "tf_legacy_loss", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "dtype", "torch_dtype", "rope_theta", "rope_scaling", "rope_parameters", "head_dim",
})
MODEL_TYPES = ("llama", "mixtral")
# rope types computed here as transformers computes them; "dynamic" equals the default up to
# max_position_embeddings, so it is taken only where the engine never goes past that
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
ROPE_KEYS = {"default": set(), "linear": {"factor"}, "dynamic": {"factor"},
             "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
             "yarn": {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                      "original_max_position_embeddings", "truncate"}}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int = 256
    eos_token_id: int = 257
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope: dict = field(default_factory=dict)  # {"rope_type": ..., its parameters}; {}: the default
    extra_eos_token_ids: tuple = ()  # more ids that end a completion (a list in config or generation config)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def rope_type(self) -> str:
        return self.rope.get("rope_type", "default")

    @property
    def eos_token_ids(self) -> frozenset:
        return frozenset((self.eos_token_id, *self.extra_eos_token_ids))

    def to_hf(self) -> dict:
        """The config.json of a Hugging Face Llama (or Mixtral, with experts)."""
        skip = ("extra", "num_local_experts", "num_experts_per_tok", "rope", "extra_eos_token_ids")
        out = {k: v for k, v in asdict(self).items() if k not in skip}
        out.update(
            architectures=["MixtralForCausalLM" if self.is_moe else "LlamaForCausalLM"],
            model_type="mixtral" if self.is_moe else "llama",
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            initializer_range=0.02,
            rope_scaling=dict(self.rope) if self.rope_type != "default" else None,
            use_cache=True,
        )
        if self.extra_eos_token_ids:
            out["eos_token_id"] = [self.eos_token_id, *self.extra_eos_token_ids]
        if self.is_moe:
            out.update(num_local_experts=self.num_local_experts, num_experts_per_tok=self.num_experts_per_tok)
        out.update(self.extra)
        return out

    @classmethod
    def from_hf(cls, data: dict) -> "ModelConfig":
        """A Hugging Face Llama or Mixtral config.json, as transformers 4 or 5 writes it.  A key that would
        change the math and is not implemented here raises UnsupportedConfig naming it."""
        def refuse(key, why):
            raise UnsupportedConfig(f"config.json {key}: {why}; the reference engine does not implement it "
                                    "(it would compute another model than the checkpoint's)")
        model_type = data.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            refuse("model_type", f"{model_type!r} (the reference engine runs {' and '.join(MODEL_TYPES)})")
        if data.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", f"{data['hidden_act']!r} (only silu)")
        for key in ("attention_bias", "mlp_bias"):
            if data.get(key):
                refuse(key, "true (projections without bias only)")
        if data.get("quantization_config"):
            refuse("quantization_config", "a pre-quantized checkpoint ([service] quantization = \"int8\" quantizes "
                   "an unquantized one at load)")
        if data.get("sliding_window") not in (None, 0):
            refuse("sliding_window", f"{data['sliding_window']} (full attention only)")
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", "rope", "extra_eos_token_ids")}
        unknown = sorted(set(data) - known - INERT_KEYS - {"hidden_act", "attention_bias", "mlp_bias",
                                                           "quantization_config", "sliding_window"})
        if unknown:
            refuse(unknown[0], "is not a key the reference engine knows" + (
                f" (nor {', '.join(unknown[1:])})" if len(unknown) > 1 else "") + ": it may change the math. If it "
                "does not, remove it from config.json")
        kwargs = {k: data[k] for k in known if k in data and data[k] is not None}
        kwargs.pop("rope_theta", None)
        if "dtype" in data and data["dtype"]:  # transformers 5 writes dtype, 4 torch_dtype
            kwargs["torch_dtype"] = data["dtype"]
        eos = data.get("eos_token_id")
        if isinstance(eos, list):
            if not eos:
                refuse("eos_token_id", "an empty list")
            kwargs["eos_token_id"], kwargs["extra_eos_token_ids"] = eos[0], tuple(eos[1:])
        kwargs["head_dim"] = int(data.get("head_dim") or 0)
        for key, value in kwargs.items():  # before the arithmetic in __post_init__ can trip on them
            if key in INT_RANGES and (isinstance(value, bool) or not isinstance(value, int)):
                _invalid(key, value, "must be a whole number")
        if "num_attention_heads" in kwargs and kwargs["num_attention_heads"] < 1:
            _invalid("num_attention_heads", kwargs["num_attention_heads"], "must be at least 1")
        theta, rope = _rope_of(data, refuse)
        cfg = cls(**kwargs, rope_theta=theta, rope=rope)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Types and ranges of every value the model reads (InvalidConfig names the first one wrong)."""
        import math
        for key, (low, high) in INT_RANGES.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                _invalid(key, value, f"must be a whole number from {low} to {high}")
        if self.is_moe and self.num_experts_per_tok > self.num_local_experts:
            _invalid("num_experts_per_tok", self.num_experts_per_tok,
                     f"is more than num_local_experts ({self.num_local_experts})")
        if self.num_attention_heads % self.num_key_value_heads:
            _invalid("num_key_value_heads", self.num_key_value_heads,
                     f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            _invalid("head_dim", self.head_dim, "must be even (rotary embeddings rotate pairs)")
        for key, low, high in (("rms_norm_eps", 0.0, 1.0), ("rope_theta", 0.0, 1e12)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not low < value < high:
                _invalid(key, value, f"must be a finite number above {low:g} and below {high:g}")
        if not isinstance(self.tie_word_embeddings, bool):
            _invalid("tie_word_embeddings", self.tie_word_embeddings, "must be true or false")
        if self.torch_dtype not in DTYPE_NAMES:
            _invalid("torch_dtype", self.torch_dtype, f"is not one of {', '.join(DTYPE_NAMES)}")
        self.check_token_ids()
        _check_rope(self.rope)

    def check_token_ids(self) -> None:
        for key, value in (("bos_token_id", self.bos_token_id), ("eos_token_id", self.eos_token_id),
                           *(("eos_token_id", e) for e in self.extra_eos_token_ids)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                _invalid(key, value, f"must be a token id inside the vocabulary (0..{self.vocab_size - 1})")

    def estimate_bytes(self, dtype_bytes: int, slots: int, max_len: int, tp_size: int = 1) -> tuple[int, int]:
        """(weights, KV cache) of one rank in bytes, from the sizes alone: what the engine is about to
        allocate, so an absurd config is refused before it tries."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attn = h * self.num_attention_heads * self.head_dim * 2 + h * kv * 2
        mlp = 3 * h * self.intermediate_size * max(1, self.num_local_experts)
        router = h * self.num_local_experts
        per_layer = (attn + mlp) // tp_size + 2 * h + router
        weights = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h + self.num_hidden_layers * per_layer
        cache = 2 * self.num_hidden_layers * slots * cache_positions(max_len) * (kv // tp_size)
        return weights * dtype_bytes, cache * dtype_bytes

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelConfig":
        """config.json, and generation_config.json's end-of-sequence ids (transformers stops at those)."""
        path = Path(model_dir) / "config.json"
        cfg = cls.from_hf(json.loads(path.read_text()))
        gen = Path(model_dir) / "generation_config.json"
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None
        if isinstance(eos, int):
            eos = [eos]
        if isinstance(eos, list) and eos and all(isinstance(e, int) for e in eos):
            cfg.eos_token_id, cfg.extra_eos_token_ids = eos[0], tuple(eos[1:])
            try:
                cfg.check_token_ids()
            except InvalidConfig as e:
                raise InvalidConfig(str(e).replace("config.json", "generation_config.json")) from None
        return cfg


def _invalid(key: str, value, why: str):
    raise InvalidConfig(f"config.json {key} = {json.dumps(value) if _plain(value) else repr(value)} {why}; fix "
                        "the checkpoint's config.json")


def _plain(value) -> bool:
    import math
    return isinstance(value, (int, str, bool)) or (isinstance(value, float) and math.isfinite(value))


def _check_rope(rope: dict) -> None:
    """Every rope scaling parameter a finite number in its range (a factor of -4 is not a model)."""
    import math
    positive = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim", "original_max_position_embeddings")
    for key in positive:
        if key not in rope or (key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow")
                               and rope[key] is None):
            continue
        value = rope[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            _invalid(f"rope_scaling.{key}", value, "must be a finite number above 0")
    if rope.get("rope_type") == "llama3" and rope["low_freq_factor"] == rope["high_freq_factor"]:
        _invalid("rope_scaling.high_freq_factor", rope["high_freq_factor"], "must differ from low_freq_factor")
    if "truncate" in rope and not isinstance(rope["truncate"], bool):
        _invalid("rope_scaling.truncate", rope["truncate"], "must be true or false")


def _rope_of(data: dict, refuse) -> tuple[float, dict]:
    """rope_theta and the rope dict from transformers 5's rope_parameters or 4's rope_theta + rope_scaling."""
    params = data.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and "type" not in params and any(
            isinstance(v, dict) for v in params.values()):
        refuse("rope_parameters", "one per layer type")
    rope = dict(params) if isinstance(params, dict) else dict(data.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:  # the older spelling
        rope["rope_type"] = rope.pop("type")
    rope.pop("type", None)
    theta = rope.pop("rope_theta", None)
    theta = data.get("rope_theta") if theta is None else theta
    theta = 10000.0 if theta is None else theta  # transformers' default
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        _invalid("rope_theta", theta, "must be a number")
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        refuse("rope_scaling" if "rope_scaling" in data else "rope_parameters",
               f"rope_type {kind!r} (implemented: {', '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("rope partial_rotary_factor", str(rope["partial_rotary_factor"]))
    rope.pop("partial_rotary_factor", None)
    extra = set(rope) - ROPE_KEYS[kind] - {"rope_type"}
    if extra:
        refuse(f"rope {', '.join(sorted(extra))}", f"not a parameter of rope_type {kind!r}")
    if kind == "yarn" and not rope.get("original_max_position_embeddings"):
        rope["original_max_position_embeddings"] = data.get("max_position_embeddings", 2048)
    if kind == "default":
        rope = {}
    return float(theta), rope
