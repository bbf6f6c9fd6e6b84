"""Checkpoints written by transformers itself (random weights, a byte-level tokenizer beside them),
for the tests that compare the reference engine with transformers."""
import json

import torch
import transformers

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256, eos_token_id=257)


def tokenizer(out, bos: bool, chat_template: str | None = None) -> None:
    """A byte-level tokenizer saved beside the checkpoint (byte b is token b, then BOS and EOS); `bos`:
    its post-processor puts BOS first, as Llama 3's does; without, nothing is added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from restartkit.reference.model.checkpoint import bytes_to_unicode
    alphabet = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 256)])
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def checkpoint(out, *, moe=False, bos=True, seed=0, as_v4=False, chat_template=None, **cfg):
    """A checkpoint transformers writes (save_pretrained), random weights; `as_v4`: its config rewritten
    the way transformers 4 wrote it (rope_theta beside rope_scaling, torch_dtype)."""
    torch.manual_seed(seed)
    if moe:
        conf = transformers.MixtralConfig(**{**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, **cfg})
        model = transformers.MixtralForCausalLM(conf)
    else:
        conf = transformers.LlamaConfig(**{**SMALL, **cfg})
        model = transformers.LlamaForCausalLM(conf)
    with torch.no_grad():  # larger weights than the init's: logits far apart, greedy choices not near ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25 if p.shape[0] != SMALL["vocab_size"] else 1.0)
    model.save_pretrained(out)
    tokenizer(out, bos, chat_template)
    if as_v4:
        data = json.loads((out / "config.json").read_text())
        if "rope_parameters" in data:  # (transformers 4 itself writes this layout already)
            rope = data.pop("rope_parameters")
            data["rope_theta"] = rope.pop("rope_theta")
            data["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        if "dtype" in data:
            data["torch_dtype"] = data.pop("dtype")
        (out / "config.json").write_text(json.dumps(data))
    return model.eval()


