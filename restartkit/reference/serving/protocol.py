"""The OpenAI API as clients use it, on the reference engine: a request's fields read and checked
(each one honoured or refused with a 400 naming it, never ignored), chat messages rendered with
the tokenizer's own chat template, and text produced token by token for streaming and stop strings.
HTTP itself (JSON answers, server-sent events) is api.py's."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path


class BadRequest(ValueError):
    """A 400 naming the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# fields both endpoints honour, and the value each refused field may still carry (its neutral value)
SAMPLING = {"top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "stop_token_ids", "ignore_eos", "min_tokens"}  # OpenAI's, and vLLM's extensions
COMMON = {"model", "max_tokens", "temperature", "seed", "n", "stop", "stream", "stream_options", "user",
          "return_token_ids", "include_stop_str_in_output"} | SAMPLING
NEUTRAL = {"logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
           "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
           "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, True, False),
           "store": (None, False), "metadata": None, "service_tier": (None, "auto", "default")}
WHY = {"logit_bias": "logit bias is not implemented", "best_of": "best_of is not implemented; ask for n choices",
       "suffix": "insertion (suffix) is not implemented", "tools": "tool calls are not implemented",
       "tool_choice": "tool calls are not implemented", "functions": "function calls are not implemented",
       "function_call": "function calls are not implemented",
       "response_format": "structured output is not implemented (text only)",
       "parallel_tool_calls": "tool calls are not implemented", "store": "stored completions are not kept",
       "service_tier": "there is one service tier"}
COMPLETION_FIELDS = COMMON | set(NEUTRAL) | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON | set(NEUTRAL) | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
MAX_N = 16
MAX_STOP = 4


@dataclass
class Ask:
    """One request, read and checked."""
    prompts: list[list[int]]  # token ids of each prompt (chat: one, the rendered conversation)
    prompt_texts: list[str]  # for echo
    max_tokens: int | None  # None: as many as max_model_len leaves
    temperature: float
    seed: int | None
    n: int
    stop: list[str]
    want_logprobs: bool
    top_logprobs: int
    echo: bool
    stream: bool
    include_usage: bool
    chat: bool
    sampling: dict = field(default_factory=dict)  # top_p .. min_tokens (sched.sequence.Sampling's names)
    include_stop: bool = False  # the stop string found ends the text (vLLM's include_stop_str_in_output)
    token_ids: bool = False  # return_token_ids (vLLM's): each choice, and each streamed chunk, carries its token ids
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def _int(body: dict, key: str, default, low: int, high: int | None = None) -> int:
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer, not {v!r}", key)
    if v < low or (high is not None and v > high):
        raise BadRequest(f"{key} must be between {low} and {high}" if high is not None else f"{key} must be at least {low}",
                         key)
    return v


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key in sorted(body):
        if key not in allowed:
            raise BadRequest(f"unknown field {key!r}: the reference engine does not implement it", key)
        if key in NEUTRAL and NEUTRAL[key] is not None and body[key] not in NEUTRAL[key]:
            raise BadRequest(f"{key} = {json.dumps(body[key])[:80]} is not supported: {WHY[key]}", key)


def _common(body: dict, chat: bool) -> dict:
    """max_tokens None: as many as the engine's max_model_len leaves (chat's default); completions' is 16."""
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = None if chat and body.get(key) is None else _int(body, key, 16, 1)
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature == 0 or MIN_SCALE <= temperature <= 2):  # a subnormal one divides the logits into inf
        raise BadRequest(f"temperature must be 0 (greedy) or a number from {MIN_SCALE:g} to 2, not "
                         f"{json.dumps(temperature)[:40]}", "temperature")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64):
        raise BadRequest(f"seed must be an integer from -2**63 to 2**64 - 1, not {str(seed)[:40]}", "seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
    include_stop = body.get("include_stop_str_in_output") or False
    if not isinstance(include_stop, bool):
        raise BadRequest("include_stop_str_in_output must be true or false", "include_stop_str_in_output")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise BadRequest("stream_options takes include_usage only, and only with stream: true", "stream_options")
    token_ids = body.get("return_token_ids") or False
    if not isinstance(token_ids, bool):
        raise BadRequest("return_token_ids must be true or false", "return_token_ids")
    return {"max_tokens": max_tokens, "temperature": float(temperature), "seed": seed, "token_ids": token_ids,
            "n": _int(body, "n", 1, 1, MAX_N), "stop": stop, "stream": stream, "include_stop": include_stop,
            "include_usage": bool((opts or {}).get("include_usage")), "sampling": _sampling(body, max_tokens)}


MIN_SCALE = 1e-5  # the smallest temperature or repetition penalty: logits are divided by it


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not (
            (low < v if low_open else low <= v) and v <= high):
        raise BadRequest(f"{key} must be a number {'above' if low_open else 'from'} {low:g} "
                         f"{'and at most' if low_open else 'to'} {high:g}, not {json.dumps(v)[:40]}", key)
    return float(v)


def _sampling(body: dict, max_tokens: int | None) -> dict:
    """The sampling fields beyond temperature, checked (vLLM's ranges)."""
    top_k = _int(body, "top_k", 0, -1)
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or len(ids) > 64 or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise BadRequest("stop_token_ids must be a list of up to 64 token ids", "stop_token_ids")
    ignore_eos = body.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be true or false", "ignore_eos")
    min_tokens = _int(body, "min_tokens", 0, 0, max_tokens)
    return {"top_p": _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), "top_k": max(top_k, 0),
            "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
            "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            "repetition_penalty": _number(body, "repetition_penalty", 1.0, MIN_SCALE, 10.0),
            "stop_token_ids": tuple(ids), "ignore_eos": ignore_eos, "min_tokens": min_tokens}


def read_completion(body: dict, tokenizer, encode) -> Ask:
    """/v1/completions: a prompt (text, token ids, or a list of either), logprobs (0..5: the k likeliest
    tokens too), echo."""
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    many = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) else [prompt]
    prompts, texts = [], []
    for p in many:
        if isinstance(p, str):
            prompts.append(encode(tokenizer, p))
            texts.append(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if (bad := next((t for t in p if not 0 <= t < 1 << 31), None)) is not None:  # the vocabulary: the engine's
                raise BadRequest(f"prompt token id {bad} is not a token id (0 or more)", "prompt")
            prompts.append(list(p))
            texts.append(tokenizer.decode(p, skip_special_tokens=True))
        else:
            raise BadRequest("prompt must be a string, a list of token ids, or a list of either", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is False:
        logprobs = None
    if logprobs is not None:
        logprobs = _int(body, "logprobs", 0, 0, 5)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise BadRequest("echo must be true or false", "echo")
    if echo and logprobs is not None:
        raise BadRequest("echo with logprobs would need the prompt's logprobs, which are not computed", "echo")
    return Ask(prompts=prompts, prompt_texts=texts, want_logprobs=logprobs is not None, top_logprobs=logprobs or 0,
               echo=echo, chat=False, **_common(body, False))


def read_chat(body: dict, tokenizer, template: str | None, special: dict) -> Ask:
    """/v1/chat/completions: messages rendered with the tokenizer's chat template (a 400 when it has none),
    logprobs (true/false) and top_logprobs (0..20)."""
    _check_fields(body, CHAT_FIELDS)
    ids, text = _chat(body, tokenizer, template, special)
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise BadRequest("logprobs must be true or false", "logprobs")
    top = _int(body, "top_logprobs", 0, 0, 20)
    if top and not logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return Ask(prompts=[ids], prompt_texts=[text], want_logprobs=logprobs, top_logprobs=top, echo=False, chat=True,
               **_common(body, True))


def chat_ids(body: dict, tokenizer, template: str | None, special: dict) -> list[int]:
    """The token ids of a request's messages rendered with the chat template (/tokenize)."""
    return _chat(body, tokenizer, template, special)[0]


def _chat(body: dict, tokenizer, template: str | None, special: dict) -> tuple[list[int], str]:
    """The messages checked and rendered: (token ids, text)."""
    if template is None:
        raise BadRequest("this model's tokenizer has no chat template (tokenizer_config.json chat_template, or "
                         "chat_template.jinja): use /v1/completions", "messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise BadRequest(f"messages[{i}] must have a role of system, developer, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be text", "messages")
        plain.append({"role": m["role"], "content": content})
    text = render_chat(template, plain, special)
    return tokenizer.encode(text, add_special_tokens=False).ids, text  # the template writes the special tokens


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A text prompt's token ids with the special tokens the tokenizer itself adds (its post-processor:
    BOS for Llama 3's, nothing for one without), as transformers encodes it."""
    return tokenizer.encode(prompt).ids


# ---- chat templates ------------------------------------------------------------------------

def chat_template(model_dir: str | Path) -> tuple[str | None, dict]:
    """The tokenizer's chat template (tokenizer_config.json chat_template, chat_template.jinja or
    chat_template.json, as transformers saves it) and the special tokens a template may name."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(key)
        special[key] = v.get("content", "") if isinstance(v, dict) else (v or "")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if not template and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    if not template and (d / "chat_template.json").is_file():
        try:
            template = json.loads((d / "chat_template.json").read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            template = None
    return (template if isinstance(template, str) and template else None), special


def render_chat(template: str, messages: list[dict], special: dict) -> str:
    """The conversation as the model was trained to see it, with the assistant's turn opened; the
    template runs sandboxed, with the names transformers gives it."""
    from datetime import datetime

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise BadRequest(f"the chat template refused the messages: {message}", "messages")

    class Bounded(ImmutableSandboxedEnvironment):
        """Jinja's sandbox, with repetition (`'x' * n`, `[..] * n`) and powers sized before they are made: the
        output limit is checked as text comes out, after an allocation that would already have been made."""
        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context, operator, left, right):
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                    and len(left) + len(right) > RENDER_MAX_CHARS:
                raise BadRequest(f"the chat template joins values past the {RENDER_MAX_CHARS} characters a rendering "
                                 "may hold", "messages")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and \
                            len(seq) * max(n, 0) > RENDER_MAX_CHARS:
                        raise BadRequest(f"the chat template repeats a value {n} times, past the {RENDER_MAX_CHARS} "
                                         "characters a rendering may hold", "messages")
            if operator == "**" and isinstance(right, int) and abs(right) > 4096:
                raise BadRequest(f"the chat template raises to the power {right}, past what a rendering may compute",
                                 "messages")
            return super().call_binop(context, operator, left, right)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(x, indent=indent,
                                                                                       ensure_ascii=ensure_ascii)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        pieces = env.from_string(template).generate(messages=messages, add_generation_prompt=True, **special)
        return _bounded(pieces, RENDER_LIMIT_S, RENDER_MAX_CHARS)
    except BadRequest:
        raise
    except TemplateError as e:
        raise BadRequest(f"the chat template failed: {e}", "messages") from None
    except RecursionError:
        raise BadRequest("the chat template recursed too deeply", "messages") from None


RENDER_LIMIT_S = 2.0  # a chat template that renders longer than this costs its request a 400, never a thread
RENDER_MAX_CHARS = 4 << 20


class _TooLong(Exception):
    pass


def _bounded(pieces, limit_s: float, max_chars: int) -> str:
    """The template's output, within a time limit (checked at every line the template's compiled code runs,
    so a loop that writes nothing is stopped too) and a size limit."""
    import sys
    end = time.monotonic() + limit_s

    def tracer(frame, event, arg):
        if time.monotonic() > end:
            raise _TooLong()
        return tracer

    out, size, before = [], 0, sys.gettrace()
    sys.settrace(tracer)
    try:
        for piece in pieces:
            size += len(piece)
            if size > max_chars:
                raise BadRequest(f"the chat template's output is over {max_chars} characters", "messages")
            out.append(piece)
    except _TooLong:
        raise BadRequest(f"the chat template took more than {limit_s:g} s to render", "messages") from None
    finally:
        sys.settrace(before)
    return "".join(out)


# ---- text, token by token ------------------------------------------------------------------

class Decoding:
    """The text of a completion's tokens as they come, each token decoding a few tokens only: the ones since the
    last point where the text was whole (no character's first bytes pending), with those before them as context, so
    a decoder that treats a text's first token apart (SentencePiece's leading space) decodes as it does for the
    whole.  A decoder whose text of the window does not extend its context's (a clean-up that joins across tokens)
    is decoded whole from then on.  Decoding everything at every token cost a 2,000-token answer's stream 0.13 s
    of the serving thread on a 258-token vocabulary, growing with the square of the length."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.whole = ""  # the text of tokens[:read]
        self.context = self.read = 0  # the window decodes tokens[context:], its context tokens[context:read]
        self.incremental = True

    def add(self, token: int) -> str:
        """The text of every token so far, a character still incomplete as U+FFFD."""
        self.tokens.append(token)
        if not self.incremental:
            return self._decode(self.tokens)
        before = self._decode(self.tokens[self.context:self.read])
        now = self._decode(self.tokens[self.context:])
        if not now.startswith(before):
            self.incremental = False
            return self._decode(self.tokens)
        new = now[len(before):]
        if new.endswith("\ufffd"):
            return self.whole + new
        self.whole += new
        self.context, self.read = self.read, len(self.tokens)
        return self.whole

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class TextSoFar:
    """The completion's text as its tokens come (each token the scheduler sends): what may be sent already
    (not a byte of a character still incomplete, not what may turn out to start a stop string), and
    where a stop string ends it (OpenAI leaves the stop string out of the text).  `send(piece)`: the
    piece covers the tokens seen so far (their logprobs go with it).  `aligned`: text is let go only where
    it is the whole text of the tokens so far (nothing held back), so each piece ends at a token boundary
    (streams that carry token ids: their reader may continue the request from them, restartkit.front).
    `each_token`: every token sends a piece, empty while its text is held back (as vLLM streams: a client sees
    each token come, its id and logprob with it, and times its first token by the first chunk)."""

    def __init__(self, tokenizer, stop: list[str], send=None, aligned: bool = False, each_token: bool = False,
                 include_stop: bool = False):
        self.tokenizer, self.stop, self.send, self.aligned, self.each_token = tokenizer, stop, send, aligned, each_token
        self.include_stop = include_stop  # the stop string stays in the text
        self.decoding = Decoding(tokenizer)
        self.logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.text, self.sent, self.stopped, self.gone = "", 0, False, False

    @property
    def tokens(self) -> list[int]:
        return self.decoding.tokens

    def __call__(self, token: int, logprob: float | None = None, top: dict | None = None) -> bool:
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        seen = len(self.text.rstrip("\ufffd"))  # the text before a character still incomplete stays
        full = self.decoding.add(token)
        # a stop string found now ends in the new text: it starts at most its length back from there
        cut, hit = min(((i, s) for s in self.stop if (i := full.find(s, max(0, seen - len(s)))) >= 0),
                       default=(-1, ""))
        if cut >= 0:
            self.text, self.stopped = full[:cut + (len(hit) if self.include_stop else 0)], True
            self._send(len(self.text))
            return True
        self.text = full
        safe = len(full.rstrip("\ufffd"))  # a character whose bytes are not all here yet
        for s in self.stop:  # the end of the text may be the start of a stop string
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    safe = min(safe, len(full) - k)
                    break
        if self.aligned and safe < len(full):
            safe = self.sent  # wait until this token's text is whole
        self._send(safe, self.each_token)
        return self.gone  # a client gone: no use computing more

    def finish(self, tokens: list[int]) -> str:
        """The whole text once the engine is done (`tokens`: all it returned), the rest of it sent."""
        if not self.stopped:
            self.text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        self._send(len(self.text))
        return self.text

    def _send(self, upto: int, even_empty: bool = False) -> None:
        if self.send is not None and (upto > self.sent or even_empty) and not self.gone:
            try:
                self.send(self.text[self.sent:upto] if upto > self.sent else "")
            except OSError:
                self.gone = True
        self.sent = max(self.sent, upto)
