"""/v1/completions and /v1/chat/completions over the scheduler: a request's prompts x n choices
become sequences (restartkit.reference.sched), submitted together; their tokens come back as
events, turned into text (stop strings, streaming, logprobs) here.  A request is bounded before
it queues; a client that leaves has its sequences cancelled at the scheduler's next step."""
from __future__ import annotations

import os
import queue
import select
import socket
import time
from dataclasses import dataclass, field

from restartkit.contracts import CANARY_HEADER

CHECK_CLIENT_S = 0.1  # how often a request waiting on its tokens looks whether its client left


class ClientGone(Exception):
    """The client closed its connection: its sequences are cancelled, nothing more is written."""


@dataclass
class _Choice:
    """One choice's tokens as they come, and what has been made of them."""
    so_far: object  # completions.TextSoFar
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)


class CompletionRoutes:
    """The completion routes of the reference engine's HTTP handler (api.Handler)."""

    def _complete(self, body: dict, chat: bool) -> None:
        """/v1/completions and /v1/chat/completions, streamed (server-sent events ending in [DONE]) or not;
        n choices per prompt, stop strings, logprobs, echo (restartkit.reference.serving.protocol)."""
        from restartkit.reference.runtime.runner import EngineNotReady
        from restartkit.reference.sched.scheduler import EngineGone, Overloaded
        from restartkit.reference.serving.protocol import BadRequest, encode_prompt, read_chat, read_completion
        st = self.server.state
        if not self._serving() or self._wrong_model(body.get("model")):
            return
        t0 = time.perf_counter()
        try:
            ask = (read_chat(body, st.tokenizer, st.chat_template, st.special_tokens) if chat
                   else read_completion(body, st.tokenizer, encode_prompt))
            seqs = self._sequences(ask)
        except BadRequest as e:
            self._error(400, str(e), param=e.param)
            return
        except ValueError as e:  # the engine's own checks: prompt length, token ids
            self._error(400, str(e))
            return
        except EngineNotReady as e:
            self._error(503, f"the engine is not ready: {e}", "unavailable")
            return
        try:
            st.scheduler.submit(seqs, first=self._canary())
        except Overloaded as e:
            self._error(503, f"the engine is busy: {e}", "unavailable")
            return
        try:
            if ask.stream:
                self._events_begin()
                if chat:  # the assistant's turn opens
                    self._event(self._chunk(ask, 0, {"role": "assistant", "content": ""}, None,
                                            ids=[] if ask.token_ids else None, prompt=seqs[0].prompt))
            choices, usage = self._collect(ask, seqs)
        except (EngineGone, EngineNotReady) as e:  # asleep, or its cache dropped, after the check above
            if not ask.stream:
                self._error(503, f"the engine is not ready: {e}", "unavailable")
            else:  # a stream ends without [DONE]: the client sees it cut
                self._events_end(whole=False)
            return
        except (ClientGone, OSError):
            self._client_left(len(seqs))
            return
        finally:
            for seq in seqs:  # those not finished leave the batch at the next step
                seq.cancel()
        self._count(usage)
        if ask.stream:
            if ask.include_usage:
                self._event({**self._head(ask), "choices": [], "usage": usage})
            self._event(b"[DONE]")
            self._events_end()
        else:
            self._send(200, {**self._head(ask), "choices": choices, "usage": usage,
                             "system_fingerprint": f"restartkit-ref-{os.getpid()}"})
        if "first_request" not in st.phases:  # after a restart, restartkit's readiness probe
            st.phases["first_request"] = round(time.perf_counter() - t0, 4)

    def _count(self, usage: dict) -> None:
        st = self.server.state
        st.requests += 1
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        st.metrics.prompt_tokens.inc(usage["prompt_tokens"])
        st.metrics.generation_tokens.inc(usage["completion_tokens"])

    def _client_left(self, sequences: int) -> None:
        """One line of the log for a client that closed before its answer was written."""
        from restartkit.reference.log import log
        log(f"client {self.client_address[0]}:{self.client_address[1]} closed before its answer; its {sequences} "
            "sequence(s) cancelled")
        self.close_connection = True

    def _canary(self) -> bool:
        """restartkit's canary (its header and the admin token): it goes first, past the queue's limits, so that a
        backlog of clients never makes restartkit discard a good engine."""
        return self.headers.get(CANARY_HEADER) is not None and self._admin_sent()

    def _wrong_model(self, model) -> bool:
        """A 404 for a model this engine does not serve (absent: the one it serves)."""
        served = self.server.state.model_name
        if model is None or model == served:
            return False
        self._error(404, f"The model `{str(model)[:200]}` does not exist: this engine serves `{served}` "
                    "(GET /v1/models)", "NotFoundError", "model")
        return True

    def _sequences(self, ask) -> list:
        """The request's sequences (prompt by prompt, n choices each), checked against the engine and
        bounded: prompts x n x (prompt + max_tokens) tokens at most max_num_seqs x max_model_len."""
        from restartkit.reference.sched.sequence import Sampling, Sequence
        from restartkit.reference.serving.protocol import BadRequest
        eng = self.server.state.engine
        o = eng.options
        # restartkit's canary, and speculative decoding, run in a batch of their own (see sched.scheduler)
        isolated = self.headers.get(CANARY_HEADER) is not None or (
            eng.draft is not None and ask.temperature == 0)  # (speculative only where sampling is plain greedy)
        events, seqs = queue.SimpleQueue(), []
        vocab = eng.config.vocab_size
        if bad := [i for i in ask.sampling.get("stop_token_ids", ()) if i >= vocab]:
            raise BadRequest(f"stop_token_ids: {bad[0]} is outside the vocabulary (0..{vocab - 1})", "stop_token_ids")
        for pi, ids in enumerate(ask.prompts):
            max_tokens = ask.max_tokens or max(1, o.max_model_len - len(ids))
            eng.check_prompt(ids, max_tokens)
            for j in range(ask.n):
                # choice j of n samples with its own seed (greedy choices are alike whatever the seed)
                seed = ask.seed + j if ask.seed is not None else None if j == 0 else o.seed + j
                if ask.sampling.get("min_tokens", 0) > max_tokens:
                    raise BadRequest(f"min_tokens ({ask.sampling['min_tokens']}) is more than max_tokens "
                                     f"({max_tokens})", "min_tokens")
                sampling = Sampling(max_tokens, ask.temperature, seed, ask.want_logprobs, ask.top_logprobs,
                                    **ask.sampling)
                seqs.append(Sequence(ids, sampling, index=pi * ask.n + j, events=events, isolated=isolated,
                                     quiet=not (ask.stream or ask.stop)))
        work, limit = sum(len(s.prompt) + s.sampling.max_tokens for s in seqs), o.max_num_seqs * o.max_model_len
        if work > limit:
            raise BadRequest(f"the request asks for up to {work} tokens (prompt and max_tokens, for each prompt and "
                             f"each of n choices); the limit is max_num_seqs x max_model_len = {limit}: ask for fewer "
                             "prompts, a smaller n or max_tokens", "max_tokens")
        if len(seqs) > self.server.state.scheduler.max_waiting and not self._canary():
            raise BadRequest(f"the request has {len(seqs)} sequences (prompts x n); at most "
                             f"{self.server.state.scheduler.max_waiting} can wait for the engine", "n")
        return seqs

    def _collect(self, ask, seqs: list) -> tuple[list[dict], dict]:
        """Read the sequences' events until every choice has ended: text as it comes (streamed when asked,
        each chunk with the logprobs of the tokens its text completes), a stop string ending its choice
        (which is cancelled).  Returns the choices (not streamed) and the usage."""
        from restartkit.reference.serving.protocol import TextSoFar
        st = self.server.state
        usage = {"prompt_tokens": sum(len(p) for p in ask.prompts) * ask.n, "completion_tokens": 0}
        by_index = {s.index: s for s in seqs}
        state: dict[int, _Choice] = {}
        for seq in seqs:
            so_far = TextSoFar(st.tokenizer, ask.stop, aligned=ask.stream and ask.token_ids, each_token=ask.stream,
                                include_stop=ask.include_stop)
            c = state[seq.index] = _Choice(so_far, seq.prompt)
            if ask.stream:
                so_far.send = _Streamed(self, ask, seq.index, so_far, seq.prompt)
                if ask.echo:
                    self._event(self._chunk(ask, seq.index, ask.prompt_texts[seq.index // ask.n], None))
        choices, left, events, checked = {}, set(by_index), seqs[0].events, time.monotonic()
        started, first = getattr(self, "_started", time.perf_counter()), True
        while left:
            try:
                ev = events.get(timeout=CHECK_CLIENT_S)
            except queue.Empty:
                ev = None
            if time.monotonic() - checked >= CHECK_CLIENT_S:
                checked = time.monotonic()
                if self._client_gone():
                    raise ClientGone()
            if ev is None or ev.index not in left:  # nothing yet, or a token after its choice stopped
                continue
            c = state[ev.index]
            if ev.kind == "error":
                raise ev.error
            finish = ev.finish if ev.kind == "done" else None
            if ev.kind == "token":
                if first:
                    st.metrics.first_token.observe(ev.at - started)
                    first = False
                c.tokens.append(ev.token)
                c.logprobs.append(ev.logprob)
                c.top_logprobs.append(ev.top)
                watch = ask.stream or ask.stop  # else the text is made once, at the end
                if watch and not ev.eos and c.so_far(ev.token, ev.logprob, ev.top):
                    if c.so_far.gone:
                        raise ClientGone()
                    by_index[ev.index].cancel()
                    finish = "stop"
            if finish is not None:
                left.discard(ev.index)
                usage["completion_tokens"] += len(c.tokens)
                choices[ev.index] = self._end_choice(ask, ev.index, c, finish)
        return [choices[i] for i in sorted(choices)], usage

    def _end_choice(self, ask, index: int, c: _Choice, finish: str) -> dict | None:
        """A choice that ended: its last chunk (streamed: the finish reason, the logprobs of what remains,
        an EOS), or the whole choice."""
        text = c.so_far.finish(c.tokens)
        finish = "stop" if c.so_far.stopped else finish
        comp = _Completion(c.prompt, c.tokens, c.logprobs if ask.want_logprobs else None,
                           c.top_logprobs if ask.top_logprobs else None)
        if ask.stream:
            stream = c.so_far.send
            self._event(self._chunk(ask, index, {} if ask.chat else "", finish,
                                    stream.logprobs(comp.tokens, comp.logprobs, comp.top_logprobs), stream.ids(comp.tokens),
                                    None if stream.opened else stream.prompt))
            return None
        echo = ask.prompt_texts[index // ask.n] if ask.echo else ""
        return self._choice(ask, index, echo + text, finish, comp)

    def _client_gone(self) -> bool:
        """The client closed its end (it reads as end-of-file; a pipelined next request is not an end)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _head(self, ask, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if ask.chat else "text_completion"
        return {"id": f"{'chatcmpl' if ask.chat else 'cmpl'}-{ask.id}", "object": kind, "created": ask.created,
                "model": self.server.state.model_name}

    def _chunk(self, ask, index: int, piece, finish, logprobs=None, ids=None, prompt=None) -> dict:
        """`ids`: the tokens this chunk's text completes (return_token_ids), `prompt`: the prompt's, in a
        choice's first chunk."""
        if ask.chat:
            delta = piece if isinstance(piece, dict) else {"content": piece}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish}
        if ask.token_ids and ids is not None:
            choice["token_ids"] = ids
            if prompt is not None:
                choice["prompt_token_ids"] = prompt
        return {**self._head(ask, chunk=True), "choices": [choice]}

    def _choice(self, ask, index: int, text: str, finish: str, comp) -> dict:
        logprobs = self._logprobs(ask, comp) if ask.want_logprobs else None
        if ask.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish, "token_ids": comp.tokens}
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs,
                "token_ids": comp.tokens, "prompt_token_ids": comp.prompt_tokens}

    def _logprobs(self, ask, comp) -> dict:
        return self._logprobs_of(ask, comp.tokens, comp.logprobs, comp.top_logprobs)

    def _logprobs_of(self, ask, tokens: list[int], lps: list, tops: list | None, at: int = 0) -> dict:
        """OpenAI's logprobs for these tokens (chat: `content`; completions: tokens, token_logprobs,
        top_logprobs, text_offset counted from `at`)."""
        tok = self.server.state.tokenizer
        names = [tok.id_to_token(t) or "" for t in tokens]
        each_top = tops or [None] * len(tokens)
        if ask.chat:
            def entry(t, lp):
                piece = tok.decode([t], skip_special_tokens=False)
                return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in (top or {}).items()]}
                                for t, lp, top in zip(tokens, lps, each_top)]}
        offsets = []
        for t in tokens:
            offsets.append(at)
            at += len(tok.decode([t], skip_special_tokens=True))
        return {"tokens": names, "token_logprobs": list(lps),
                "top_logprobs": [{tok.id_to_token(i) or "": v for i, v in top.items()} for top in each_top]
                if tops else None, "text_offset": offsets}


@dataclass
class _Completion:
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list | None
    top_logprobs: list | None


class _Streamed:
    """One streamed choice: each piece of text TextSoFar lets go is a chunk, with the logprobs of the
    tokens it completes (when asked), their text offsets running on from the chunk before."""

    def __init__(self, handler, ask, index: int, so_far, prompt: list[int]):
        self.handler, self.ask, self.index, self.so_far, self.prompt = handler, ask, index, so_far, prompt
        self.opened = ask.chat  # chat's first chunk (the assistant's role) carried the prompt's ids
        self.done, self.at = 0, 0  # tokens whose logprobs were sent; the text offset after them
        self.ids_sent = 0  # tokens whose ids were sent (return_token_ids)

    def __call__(self, piece: str) -> None:
        sf = self.so_far
        lps = self.logprobs(sf.tokens, sf.logprobs, sf.top_logprobs if self.ask.top_logprobs else None)
        prompt, self.opened = (None if self.opened else self.prompt), True
        self.handler._event(self.handler._chunk(self.ask, self.index, piece, None, lps, self.ids(sf.tokens), prompt))

    def ids(self, tokens: list[int]) -> list[int] | None:
        """tokens[ids_sent:] (None when not asked), counted as sent."""
        if not self.ask.token_ids:
            return None
        first, self.ids_sent = self.ids_sent, len(tokens)
        return list(tokens[first:])

    def logprobs(self, tokens: list[int], lps: list | None, tops: list | None) -> dict | None:
        """The logprobs of tokens[done:] (None when not asked, or none is left), counted as sent."""
        first, self.done = self.done, len(tokens)
        if not self.ask.want_logprobs or first >= len(tokens):
            return None
        out = self.handler._logprobs_of(self.ask, tokens[first:], lps[first:], tops[first:] if tops else None, self.at)
        if not self.ask.chat:  # the offset after these tokens: the last one's, plus its text
            tok = self.handler.server.state.tokenizer
            self.at = out["text_offset"][-1] + len(tok.decode([tokens[-1]], skip_special_tokens=True))
        return out
