"""The front: an HTTP server (aiohttp) that answers the service's clients and forwards to the engine that serves,
on the engine's own socket.  A completion in flight when its engine dies is continued on the engine that serves
next (restartkit.front.journal): its client sees a pause, not an error.

Forwarded: /v1/completions and /v1/chat/completions (journalled where they can be continued), /v1/models,
/tokenize, /detokenize, /health, /metrics (with the front's own counters appended), /version; /front/status is its
own.  Refused by name: restartkit's admin routes and sleep mode's, and anything else.  It imports no torch: it
starts in milliseconds.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
from aiohttp import web

from restartkit.front.journal import CannotContinue, Flight, journalled, sse

FORWARDED = {("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"),
             ("GET", "/metrics"), ("GET", "/version"), ("GET", "/ping")}
JOURNALLED = {"/v1/completions": False, "/v1/chat/completions": True}
REFUSED_PREFIXES = ("/admin", "/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache")
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "x-restartkit-admin"}
RETRY_PAUSE_S = 0.05
SAVE_EVERY_S = 0.25  # the counts file's period (Front.counts_file)
KEEP_IDLE_S = 2.0  # how long a connection to the engine is kept idle for the next request


class EngineDied(Exception):
    """The engine's answer broke off (its connection reset or closed before the end)."""


class Front:
    def __init__(self, upstream: str, wait_s: float = 60.0, max_in_flight: int = 4096, say=print,
                 counts_file: str | None = None):
        """`counts_file`: where the counts and the requests in flight are kept (every SAVE_EVERY_S), so that the
        next front (supervise starts one when this one dies) counts on from them, the requests in flight on a
        front that died as lost with it."""
        self.upstream, self.wait_s, self.max_in_flight, self.say = upstream.rstrip("/"), wait_s, max_in_flight, say
        self.counts = {"requests": 0, "journalled": 0, "resumed": 0, "continuations": 0, "lost": 0, "refused": 0,
                       "waited_out": 0, "lost_with_front": 0, "regenerated_held_back": 0, "retried_whole": 0}
        self.in_flight = 0  # journalled requests the front holds (waiting for an engine, or answered by one)
        self.passing = 0  # requests passed through as they are, in flight
        self.counts_file = counts_file
        if counts_file is not None:
            died_with = carry_counts(counts_file, self.counts)
            if died_with:
                say(f"front: {died_with} request(s) were in flight on the front before this one: lost with it")
        self.max_model_len: int | None = None
        self.keep_stop = True  # the engine takes include_stop_str_in_output (restartkit.front.journal)
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.route)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        # no cap of its own on connections to the engine (aiohttp's default is 100): max_in_flight bounds them,
        # and the engine's --max-num-seqs says how many run at once.  Connections are kept between requests (the
        # engines stream in chunks), idle for less than the engines keep them (5 s: uvicorn's default, and the
        # reference engine's), so that the front seldom sends on one its engine is closing
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEP_IDLE_S),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                             auto_decompress=False)
        if self.counts_file is not None:
            self._saver = asyncio.create_task(self._keep_counts())

    async def _close(self, _app) -> None:
        await self.session.close()
        if self.counts_file is not None:
            self._saver.cancel()
            self._save_counts()  # the requests still in flight now (cut by the shutdown) are lost with this front

    async def _keep_counts(self) -> None:
        last = None
        while True:
            last = self._save_counts(last)
            await asyncio.sleep(SAVE_EVERY_S)

    def _save_counts(self, last: str | None = None) -> str:
        text = json.dumps({"counts": self.counts, "in_flight": self.in_flight + self.passing})
        if text != last:
            try:
                with open(self.counts_file + ".tmp", "w") as f:
                    f.write(text)
                os.replace(self.counts_file + ".tmp", self.counts_file)
            except OSError:
                pass  # a full or read-only disk costs the count, never a request
        return text

    # ---- routing ----------------------------------------------------------------------------
    async def route(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path, request.method
        if path.startswith(REFUSED_PREFIXES):
            return _error(403, f"{path} is an engine admin route: restartkit calls it on the engine's own socket; "
                               "it is never reachable through the service's front", "forbidden")
        if path == "/front/status":  # the front's own: it answers, and what it counted
            return web.json_response({"upstream": self.upstream, "in_flight": self.in_flight, **self.counts})
        if method == "POST" and path in JOURNALLED:
            self.counts["requests"] += 1
            return await self.completion(request, JOURNALLED[path])
        if (method, path) in FORWARDED or (method == "HEAD" and path == "/health"):
            return await self.forward(request)
        return _error(404, f"{method} {path} is not a route the front forwards (the OpenAI routes, /tokenize, "
                           "/detokenize, /health and /metrics are)", "not_found")

    async def forward(self, request: web.Request) -> web.Response:
        """A short request passed through as it is, waiting while no engine serves."""
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                async with self.session.request(request.method, self.upstream + request.path_qs, data=body,
                                                headers=headers, timeout=self._left(deadline)) as r:
                    data = await r.read()
                    if request.path == "/metrics" and r.status == 200:
                        data += self.metrics().encode()
                    return web.Response(status=r.status, body=data,
                                        headers={"Content-Type": r.headers.get("Content-Type", "application/json")})
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                if time.monotonic() >= deadline:
                    return self._waited_out(e)
                await asyncio.sleep(RETRY_PAUSE_S)

    # ---- completions --------------------------------------------------------------------------
    async def completion(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not journalled(body):
            return await self.passthrough(request, raw, isinstance(body, dict) and bool(body.get("stream")))
        if self.in_flight >= self.max_in_flight:
            self.counts["refused"] += 1
            return _error(503, f"the front holds {self.in_flight} requests already (its limit)", "unavailable",
                          retry_after=self.wait_s)
        self.counts["journalled"] += 1
        self.in_flight += 1
        try:
            return await self._journalled(request, chat, body)
        finally:
            self.in_flight -= 1

    async def _journalled(self, request: web.Request, chat: bool, body: dict) -> web.StreamResponse:
        flight = Flight(chat=chat, body=body, stream=bool(body.get("stream")), role_sent=not chat,
                        keep_stop=self.keep_stop,
                        auth={k: v for k, v in request.headers.items() if k.lower() == "authorization"})
        route, upstream_body = ("/v1/chat/completions" if chat else "/v1/completions"), flight.upstream_body()
        deadline = time.monotonic() + self.wait_s
        while True:
            had = len(flight.ids)
            try:
                await self._relay(request, flight, route, upstream_body, deadline)
                break
            except _Refusal as e:  # the engine answered with an error: the client gets it
                if e.status == 400 and flight.keep_stop and flight.stops and b"include_stop_str_in_output" in e.body:
                    self.keep_stop = flight.keep_stop = False  # an engine without it: its stop strings are its own
                    try:  # the same request again (or the same continuation), without it
                        route, upstream_body = flight.continuation(await self._max_model_len(flight.auth))
                    except CannotContinue as why:
                        return await self._lost(flight.client, flight, str(why))
                    continue
                if (client := flight.client) is None:
                    return web.Response(status=e.status, body=e.body, content_type="application/json")
                await _end_with_error(client, e.body.decode(errors="replace"))
                return client
            except (EngineDied, aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                if flight.finish is None and flight.max_tokens is not None and len(flight.ids) >= flight.max_tokens:
                    flight.finish = "length"  # every token came; only the end of the answer did not
                if flight.finish is not None:
                    tail = flight.flush()  # what was held for a stop string that never came
                    if flight.stream and flight.client is not None and not flight.ended:
                        await _to_client(flight.client, sse(flight.chunk(tail, flight.finish, [])))
                    break
                if len(flight.ids) > had:  # it got somewhere: the next engine gets the whole wait again
                    deadline = time.monotonic() + self.wait_s
                elif time.monotonic() >= deadline:
                    if flight.head is None and flight.client is None:
                        return self._waited_out(e)
                    return await self._lost(flight.client, flight, f"no engine answered within {self.wait_s:g} s ({e})")
                try:
                    route, upstream_body = flight.continuation(await self._max_model_len(flight.auth))
                except CannotContinue as why:
                    return await self._lost(flight.client, flight, str(why))
                self.counts["regenerated_held_back"] += bool(flight.redo)  # continued from the client's text's end
                if flight.answering:  # an engine was answering it, and died
                    flight.answering = False
                    flight.resumed += 1
                    self.counts["continuations"] += 1
                await asyncio.sleep(RETRY_PAUSE_S)
        if flight.resumed:
            self.counts["resumed"] += 1
        if (client := flight.client) is None:  # not streamed: one whole answer
            return web.json_response(flight.answer())
        if (flight.body.get("stream_options") or {}).get("include_usage"):
            head = flight.chunk("", None, [])
            await client.write(sse({**head, "choices": [], "usage": flight.usage()}))
        await client.write(sse(b"[DONE]"))
        await client.write_eof()
        return client

    async def _relay(self, request, flight: Flight, route: str, body: dict, deadline: float) -> None:
        """One engine's stream: each chunk journalled, and passed on to a streaming client in the first answer's
        shape (flight.client, its response once begun); raises EngineDied if it broke off."""
        async with self.session.post(self.upstream + route, json=body, headers=flight.auth,
                                     timeout=self._left(deadline)) as r:
            if r.status != 200:
                data = await r.read()
                if r.status == 503:  # no engine ready yet (loading, asleep): wait for one
                    raise EngineDied(f"the engine answered 503: {data[:200]!r}")
                raise _Refusal(r.status, data)
            flight.answering = True
            done = False
            async for line in _sse_lines(r.content):
                if line == b"[DONE]":
                    done = True
                    break
                if await self._take(request, flight, json.loads(line)):
                    done = True  # a stop string ended the answer: the engine's stream is closed, its request cancelled
                    break
            if not done:
                raise EngineDied("the engine's stream ended before [DONE]")

    async def _take(self, request, flight: Flight, chunk: dict) -> bool:
        """One chunk of an engine's stream journalled and passed on; True where a stop string ended the answer."""
        if "error" in chunk and not chunk.get("choices"):
            raise _Refusal(500, json.dumps(chunk).encode())
        if flight.head is None:
            flight.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        for choice in chunk.get("choices") or ():
            prompt = choice.get("prompt_token_ids") or chunk.get("prompt_token_ids")
            if prompt is not None and flight.prompt_ids is None:
                flight.prompt_ids = list(prompt)
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason")
            ids, piece = flight.take(list(choice.get("token_ids") or ()), piece or "", finish)
            if flight.stop_reason is not None:
                finish = "stop"
            if finish is not None:
                flight.finish = finish
            if flight.stream and (piece or ids or finish or not flight.role_sent):
                if flight.client is None:
                    flight.client = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                                "Cache-Control": "no-cache"})
                    await flight.client.prepare(request)
                if piece or finish or not flight.role_sent or flight.body.get("return_token_ids"):
                    await _to_client(flight.client, sse(flight.chunk(piece, finish, ids, prompt)))
                    flight.ended = finish is not None
        return flight.stop_reason is not None

    async def passthrough(self, request: web.Request, raw: bytes, stream: bool) -> web.StreamResponse:
        """A request the front cannot continue (n > 1, logprobs, echo, tools...): forwarded as it is.  Not streamed:
        its answer read whole, then passed on, so an engine that dies before the end costs the client nothing: the
        request is sent again, whole, to the engine that serves next (as is a stream no byte of which reached the
        client).  A stream cut after its first bytes ends with an error event, never a reset."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        deadline, out = time.monotonic() + self.wait_s, None
        self.passing += 1
        try:
            while True:
                try:
                    async with self.session.post(self.upstream + request.path, data=raw, headers=headers,
                                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as r:
                        kind = r.headers.get("Content-Type", "application/json")
                        if r.status == 503:  # no engine ready yet (loading, asleep): wait for one
                            raise EngineDied(f"the engine answered 503: {(await r.read())[:200]!r}")
                        if not stream or r.status != 200:
                            data = await r.read()
                            return web.Response(status=r.status, body=data, headers={"Content-Type": kind})
                        out = web.StreamResponse(status=r.status, headers={"Content-Type": kind})
                        await out.prepare(request)
                        async for data in r.content.iter_any():
                            await _to_client(out, data)
                        await out.write_eof()
                        return out
                except (EngineDied, aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                    if out is not None:  # the client has part of a stream: it is told, and the request counted lost
                        return await self._lost(out, None, f"it cannot be continued (n > 1, logprobs, echo or "
                                                           f"tools), and part of its stream had been sent ({e})")
                    if time.monotonic() >= deadline:
                        return self._waited_out(e)
                    self.counts["retried_whole"] += 1
                    await asyncio.sleep(RETRY_PAUSE_S)
        finally:
            self.passing -= 1

    # ---- what is lost, and counted -----------------------------------------------------------
    async def _lost(self, client, flight: Flight | None, why: str):
        self.counts["lost"] += 1
        self.say(f"front: a request was lost after {len(flight.ids) if flight else 'some'} tokens: {why}")
        message = f"the engine serving this request died and the request could not be continued: {why}"
        if client is None:
            return _error(503, message, "unavailable", retry_after=self.wait_s)
        await _end_with_error(client, json.dumps({"error": {"message": message, "type": "unavailable"}}))
        return client

    def _waited_out(self, e) -> web.Response:
        self.counts["waited_out"] += 1
        return _error(503, f"no engine answered within {self.wait_s:g} s ({type(e).__name__})", "unavailable",
                      retry_after=self.wait_s)

    def metrics(self) -> str:
        lines = []
        for key, what in (("resumed", "requests continued on another engine after theirs died"),
                          ("lost", "requests lost with their engine (not continued)"),
                          ("journalled", "requests the front could continue"),
                          ("waited_out", "requests answered 503 after waiting for an engine"),
                          ("retried_whole", "requests the front cannot continue sent again whole after their engine "
                                            "died before any of the answer reached the client"),
                          ("lost_with_front", "requests in flight on a front that died (counted by the next one)")):
            name = f"restartkit_front_requests_{key}_total"
            lines += [f"# HELP {name} {what}", f"# TYPE {name} counter", f"{name} {self.counts[key]}"]
        return "\n".join(lines) + "\n"

    async def _max_model_len(self, auth: dict) -> int | None:
        if self.max_model_len is None:
            try:
                async with self.session.get(self.upstream + "/v1/models", headers=auth, timeout=self._left(
                        time.monotonic() + self.wait_s)) as r:
                    models = (await r.json()).get("data") or [{}]
                    self.max_model_len = models[0].get("max_model_len")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, ConnectionError):
                return None
        return self.max_model_len

    @staticmethod
    def _left(deadline: float) -> aiohttp.ClientTimeout:
        """The wait for an answer's head (the engine may be restarting), and for each piece of it after."""
        left = max(0.1, deadline - time.monotonic())  # a pause this long mid-answer is an engine stuck
        return aiohttp.ClientTimeout(total=None, sock_connect=left, sock_read=left)


class _Refusal(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(status)
        self.status, self.body = status, body


async def _sse_lines(content: aiohttp.StreamReader):
    """The data of each server-sent event."""
    async for raw in content:
        line = raw.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


async def _to_client(client: web.StreamResponse, data: bytes) -> None:
    """A write to the client; its failure is the client gone (the request is then cancelled), never an engine's."""
    try:
        await client.write(data)
    except (aiohttp.ClientError, ConnectionError) as e:
        raise asyncio.CancelledError(f"the client left: {e}") from e


async def _end_with_error(client: web.StreamResponse, error: str) -> None:
    await client.write(b"data: " + error.encode() + b"\n\n")
    await client.write(sse(b"[DONE]"))
    await client.write_eof()


def _error(status: int, message: str, kind: str, retry_after: float | None = None) -> web.Response:
    headers = {"Retry-After": str(max(1, int(retry_after)))} if retry_after else None
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


def carry_counts(path: str, counts: dict) -> int:
    """The counts a previous front left in `path` added to `counts`, its requests in flight counted as lost with
    it; returns how many those were."""
    try:
        with open(path) as f:
            left = json.load(f)
        died_with = int(left.get("in_flight") or 0)
        for k, v in (left.get("counts") or {}).items():
            if k in counts and isinstance(v, int):
                counts[k] += v
    except (OSError, ValueError, AttributeError, TypeError):
        return 0
    counts["lost"] += died_with
    counts["lost_with_front"] += died_with
    return died_with
