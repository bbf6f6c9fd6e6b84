"""What the front knows of each request in flight: enough to continue it on another engine.

A journalled request is one choice (n = 1) of a completion or a chat completion, without logprobs or echo.
The engine is asked for its token ids (`return_token_ids`, as vLLM names it) and streams them with the text;
the reference engine releases text only at a token boundary when asked for ids, so after every chunk the
text the client has is exactly the text of the ids the journal holds.  A continuation is then a completion
whose prompt is the prompt's token ids and the ids so far, for the tokens left (restartkit.front.proxy).

A continuation starts where the client's text ends.  An engine holds back the text of tokens that end inside a
character (their first bytes); vLLM sends their ids at once.  When the engine dies with some held back, the
continuation's prompt stops before them and the next engine generates them again: their ids are not re-sent, and
their text comes from that engine, decoded from a character boundary.  (Given a prompt that ends inside a character,
vLLM's detokenizer put the prompt's whole text into the continuation's first chunk.)

The front applies the request's stop strings itself too.  An engine holds back the text that may be the start of a
stop string (vLLM its last few characters, whatever they are) while its ids are sent: held there, that text died
with the engine.  So the engine is asked to put the stop string in its text (`include_stop_str_in_output`: vLLM then
holds nothing back, and still stops there), and the front holds what may start one (`held`): it is the client's
once the next characters show that no stop string starts there, whichever engine sends them, and a stop string
across a seam is found too.  A stop string found ends the answer (finish_reason "stop", `stop_reason` the string,
in the text only where the client asked for that) and the engine's stream is closed.  The stop strings still go to
the engine, which checks them as it would without the front (a bad one is its error).  An engine that refuses
`include_stop_str_in_output` (a 400 naming it) is asked again without it, and so is every later request: the
engine then holds and cuts its stop strings itself, as before the front.

What a continuation means: for greedy requests, and seeded sampling on the reference engine (each token's
randomness comes from the seed and its position), the whole answer is the one an undisturbed engine gives.
Unseeded sampling continues with fresh randomness: the tokens delivered stand, the rest is a different draw.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

# what makes a request one the front cannot continue (it is forwarded as it is, and lost if its engine dies)
NOT_JOURNALLED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "response_format", "tools",
                  "prompt_embeds")


class CannotContinue(Exception):
    """The request cannot be continued on another engine (its reason is the client's error event)."""


@dataclass
class Flight:
    chat: bool
    body: dict  # the client's request, as sent
    stream: bool
    auth: dict = field(default_factory=dict)  # its Authorization header, passed on to every engine that answers it
    prompt_ids: list[int] | None = None  # the prompt's token ids (chat: the rendered conversation), once known
    ids: list[int] = field(default_factory=list)  # the generated tokens the client has (or will get with the answer)
    text: str = ""  # the client's text (shown)
    held: str = ""  # text come from an engine that may be the start of a stop string: not the client's yet
    stop_reason: str | None = None  # the stop string found, which ended the answer
    keep_stop: bool = True  # ask the engine to keep a stop string in its text (False: an engine that refuses that)
    clean: int = 0  # how many of `ids` the client has the text of (the rest: a character's first bytes, held back)
    redo: list[int] = field(default_factory=list)  # held-back tokens the continuation generates again (not re-sent)
    finish: str | None = None
    head: dict | None = None  # the first answer's id, created and model: every chunk after keeps them
    role_sent: bool = False
    resumed: int = 0  # continuations made
    answering: bool = False  # an engine answers it now
    client: object = None  # the client's streamed response (aiohttp's StreamResponse), once begun
    ended: bool = False  # the client's stream has its finish chunk
    started: float = field(default_factory=time.monotonic)

    @property
    def max_tokens(self) -> int | None:
        key = "max_completion_tokens" if self.chat and self.body.get("max_completion_tokens") is not None \
            else "max_tokens"
        value = self.body.get(key)
        return 16 if value is None and not self.chat else value

    @property
    def stops(self) -> list[str]:
        stop = self.body.get("stop")
        return [stop] if isinstance(stop, str) and stop else [s for s in stop or () if s]

    def upstream_body(self) -> dict:
        """The request the engine gets first: the client's, streamed, with token ids and usage (and its stop
        strings in its text: see the module's docstring)."""
        stops = {"include_stop_str_in_output": True} if self.stops and self.keep_stop else {}
        return {**self.body, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True},
                **stops}

    def continuation(self, max_model_len: int | None) -> tuple[str, dict]:
        """(route, body) of the request that continues this one on the engine that now serves."""
        if self.prompt_ids is None:  # nothing came back yet: the request itself again
            return ("/v1/chat/completions" if self.chat else "/v1/completions"), self.upstream_body()
        done = self.ids[:self.clean] if self._may_redo() else self.ids
        self.redo = self.ids[len(done):]
        left = self.max_tokens
        if left is None:  # chat without a limit: as many as the engine's max_model_len leaves
            if not max_model_len:
                raise CannotContinue("the engine does not say its max_model_len, and the request set no max_tokens")
            left = max_model_len - len(self.prompt_ids)
        left -= len(done)
        if max_model_len and len(self.prompt_ids) + len(done) + max(left, 1) > max_model_len:
            raise CannotContinue(f"the prompt and the {len(self.ids)} tokens generated so far leave no room under "
                                 f"max_model_len ({max_model_len})")
        body = {k: v for k, v in self.body.items() if k not in (
            "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "user",
            "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")}
        if "min_tokens" in body:
            body["min_tokens"] = max(0, int(body["min_tokens"]) - len(done))
        body.update(prompt=self.prompt_ids + done, max_tokens=left, stream=True, return_token_ids=True,
                    stream_options={"include_usage": True})
        if self.stops and self.keep_stop:
            body["include_stop_str_in_output"] = True
        return "/v1/completions", body

    def _may_redo(self) -> bool:
        """Whether a continuation may start at the end of the text the client has (`clean`), generating the tokens
        held back after it again: when they come out the same (greedy) or the client never saw their ids."""
        if self.clean >= len(self.ids):
            return False
        greedy = self.body.get("temperature") == 0 or self.body.get("top_k") == 1
        return greedy or not (self.stream and self.body.get("return_token_ids"))

    def take(self, ids: list[int], piece: str, finish: str | None = None) -> tuple[list[int], str]:
        """An engine's chunk journalled: its ids less those of held-back tokens generated again (the client has
        them, or has them replaced where a sampled draw differs and it never saw them), and the client's part of
        its text (shown(); all that is held, where the engine finished).  Returns (new ids, text)."""
        new = []
        for t in ids:
            if self.redo and t == self.redo[0]:
                self.redo.pop(0)
                continue
            if self.redo:  # a different draw: the held-back tokens are replaced from here
                del self.ids[len(self.ids) - len(self.redo):]
                self.redo = []
            new.append(t)
        self.ids += new
        if piece:
            self.clean = len(self.ids) - len(self.redo)
        out = self.shown(piece)
        if finish is not None and self.stop_reason is None:
            out += self.flush()
        return new, out

    def shown(self, piece: str) -> str:
        """What of an engine's text the client gets now: up to a stop string found (then `stop_reason` is set), less
        an end that may start one (`held`).  Stop strings count from min_tokens on, as in vLLM."""
        buf, self.held = self.held + piece, ""
        if self.stop_reason is not None:
            return ""
        stops = self.stops
        if stops and len(self.ids) >= int(self.body.get("min_tokens") or 0):
            found = min(((buf.find(s), s) for s in stops if s in buf), default=None)
            if found is not None:
                at, self.stop_reason = found
                out = buf[:at] + (self.stop_reason if self.body.get("include_stop_str_in_output") else "")
                self.text += out
                return out
            keep = max((k for s in stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
            buf, self.held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += buf
        return buf

    def flush(self) -> str:
        """The held text, the client's (the answer ended otherwise than by a stop string)."""
        out, self.held = self.held, ""
        self.text += out
        return out

    def usage(self) -> dict:
        p, c = len(self.prompt_ids or ()), len(self.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def chunk(self, piece: str, finish: str | None, ids: list[int], first: dict | None = None) -> dict:
        """A chunk for the client in the first answer's shape (chat: a delta), whichever engine made it."""
        head = self.head or {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                             "created": int(time.time()), "model": self.body.get("model")}
        if self.chat:
            delta = {"content": piece} if piece or finish is None else {}
            if not self.role_sent:
                delta, self.role_sent = {"role": "assistant", **delta}, True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
        if finish is not None and self.stop_reason is not None:
            choice["stop_reason"] = self.stop_reason
        if self.body.get("return_token_ids"):
            choice["token_ids"] = ids
        out = {"id": head["id"], "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": head["created"], "model": head["model"], "choices": [choice]}
        if first is not None and self.body.get("return_token_ids"):
            out["prompt_token_ids"] = first
        return out

    def answer(self) -> dict:
        """The whole answer, for a client that did not stream."""
        head = self.head or {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                             "model": self.body.get("model")}
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None,
                      "finish_reason": self.finish}
        else:
            choice = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": self.finish}
        if self.stop_reason is not None:
            choice["stop_reason"] = self.stop_reason
        if self.body.get("return_token_ids"):
            choice["token_ids"] = list(self.ids)
            if not self.chat:
                choice["prompt_token_ids"] = list(self.prompt_ids or ())
        return {"id": head["id"], "object": "chat.completion" if self.chat else "text_completion",
                "created": head["created"], "model": head["model"], "choices": [choice], "usage": self.usage()}


def journalled(body) -> bool:
    """Whether the front can continue this request on another engine (see the module's docstring)."""
    if not isinstance(body, dict) or body.get("n", 1) not in (1, None):
        return False
    if any(body.get(k) not in (None, False, 0) for k in NOT_JOURNALLED):
        return False
    stop = body.get("stop")
    if not (stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        return False  # the engine says what is wrong with it
    prompt = body.get("prompt")
    if "messages" not in body and not (isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))):
        return False  # several prompts in one request
    return True


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
