"""The reference engine's routes beside completions, as vLLM's server offers them: /tokenize and /detokenize
(the served tokenizer, and the chat template for messages), /version, and /metrics for Prometheus
(requests, tokens, the scheduler's depth, latency histograms) through prometheus_client."""
from __future__ import annotations

import time

from restartkit import __version__

# what a latency is observed in (seconds): a one-token answer on a GPU to a long generation on a CPU
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineMetrics:
    """One engine's metrics, in a registry of its own (two engines in one test process never share one)."""

    def __init__(self, state):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("restartkit_engine_requests", "OpenAI API requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("restartkit_engine_prompt_tokens", "prompt tokens of answered requests",
                                     registry=r)
        self.generation_tokens = Counter("restartkit_engine_generation_tokens", "tokens generated", registry=r)
        self.latency = Histogram("restartkit_engine_request_latency_seconds",
                                 "from the request read to its last byte written", ["route"], buckets=BUCKETS,
                                 registry=r)
        self.first_token = Histogram("restartkit_engine_time_to_first_token_seconds",
                                     "from the request read to its first token", buckets=BUCKETS, registry=r)
        running = Gauge("restartkit_engine_sequences_running", "sequences in the running batch", registry=r)
        waiting = Gauge("restartkit_engine_sequences_waiting", "sequences queued for a KV-cache slot", registry=r)
        running.set_function(lambda: _depth(state)[0])
        waiting.set_function(lambda: _depth(state)[1])
        r.register(VllmNames([self.prompt_tokens, self.generation_tokens, self.first_token, running, waiting],
                             lambda: getattr(state, "model_name", "")))

    def render(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


# The families vLLM also has, under vLLM's names too (with its model_name label), so that dashboards and
# alerts made for vLLM read this engine.  Each is the same series as its restartkit_engine_ twin.
VLLM_NAMES = {
    "restartkit_engine_prompt_tokens": "vllm:prompt_tokens",
    "restartkit_engine_generation_tokens": "vllm:generation_tokens",
    "restartkit_engine_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "restartkit_engine_sequences_running": "vllm:num_requests_running",
    "restartkit_engine_sequences_waiting": "vllm:num_requests_waiting",
}


class VllmNames:
    """A collector that repeats `metrics`' families under vLLM's names (VLLM_NAMES)."""

    def __init__(self, metrics, model_name):
        self.metrics, self.model_name = metrics, model_name

    def collect(self):
        from prometheus_client.metrics_core import Metric
        for fam in (f for m in self.metrics for f in m.collect()):
            theirs = VLLM_NAMES[fam.name]
            out = Metric(theirs, fam.documentation + " (vLLM's name)", fam.type)
            for sample in fam.samples:
                if sample.name.endswith("_created"):
                    continue
                out.add_sample(theirs + sample.name[len(fam.name):], {"model_name": self.model_name(), **sample.labels},
                               sample.value)
            yield out


def _depth(state) -> tuple[int, int]:
    sched = state.scheduler
    return sched.depth if sched is not None else (0, 0)


class UtilityRoutes:
    """Mixed into api.Handler."""

    def _version(self) -> None:
        self._send(200, {"version": __version__, "engine": "restartkit-reference"})

    def _metrics(self) -> None:
        data = self.server.state.metrics.render()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _tokenize(self, body: dict) -> None:
        """{"prompt": text, "add_special_tokens": true} or {"messages": [...]} (the chat template applied):
        the token ids, their count and max_model_len, as vLLM answers."""
        from restartkit.reference.serving.protocol import BadRequest, chat_ids
        st = self.server.state
        if not self._serving() or self._wrong_model(body.get("model")):
            return
        try:
            if "messages" in body and "prompt" in body:
                raise BadRequest("give prompt or messages, not both", "prompt")
            if body.get("chat_template") is not None:  # only the model's own template is rendered here
                raise BadRequest("chat_template is not accepted: this engine renders the model's own template",
                                 "chat_template")
            if "messages" in body:
                ids = chat_ids(body, st.tokenizer, st.chat_template, st.special_tokens)
            else:
                prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
                if not isinstance(prompt, str) or not isinstance(special, bool):
                    raise BadRequest("prompt must be a string (and add_special_tokens true or false)", "prompt")
                ids = st.tokenizer.encode(prompt, add_special_tokens=special).ids
        except BadRequest as e:
            self._error(400, str(e), param=e.param)
            return
        self._send(200, {"count": len(ids), "max_model_len": st.engine.options.max_model_len, "tokens": ids,
                         "token_strs": None})

    def _detokenize(self, body: dict) -> None:
        st = self.server.state
        if not self._serving() or self._wrong_model(body.get("model")):
            return
        ids = body.get("tokens")
        size = st.tokenizer.get_vocab_size()
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < size
                                                for t in ids):
            self._error(400, f"tokens must be a list of token ids (0..{size - 1})", param="tokens")
            return
        self._send(200, {"prompt": st.tokenizer.decode(ids, skip_special_tokens=False)})

    def _observe(self, path: str, started: float) -> None:
        """A finished request to an OpenAI route, in /metrics."""
        metrics = self.server.state.metrics
        if metrics is None or not path.startswith("/v1/"):
            return
        route = path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models") else "other"
        metrics.requests.labels(route, str(getattr(self, "_status", 0))).inc()
        metrics.latency.labels(route).observe(time.perf_counter() - started)
