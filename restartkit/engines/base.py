"""What restartkit needs to know about an engine, one adapter per engine."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from restartkit import http
from restartkit.contracts import CANARY_HEADER



def local_model_problem(model: str) -> str | None:
    """For engines that take a hub id or a directory: a model written as a path (/, ./, ../, ~) must be a
    checkpoint directory, else the engine would take it for a hub id and fail later, and differently."""
    import os
    if not model.startswith(("/", "./", "../", "~")):
        return None  # a hub id
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        return f"model directory {model} does not exist (a path, not a hub id)"
    if not os.path.exists(os.path.join(path, "config.json")):
        return f"{model} has no config.json: not a Hugging Face checkpoint directory"
    return None

@dataclass
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]
    unset: tuple[str, ...] = ()  # variables of restartkit's own environment the engine must not inherit


class EngineAdapter:
    name = "base"
    label = "the engine"  # how messages name it
    waits_for_previous = False  # can a new engine start while the old one tears down (see Service.hand_over)?
    # does the engine write a byte to the file descriptor in RESTARTKIT_READY_FD once it is ready (and close it)?
    # restartkit then probes at once instead of polling; the probe (a real completion) still decides
    signals_ready = False
    # can the engine serve on a listening socket it inherits (--listen-fd N), accepting only once ready?  Under
    # supervise the service's socket then outlives every engine (restartkit.process.listener)
    serves_on_socket = False

    def launch(self, policy, extra_args: list[str] = ()) -> LaunchSpec:
        raise NotImplementedError

    def model_problem(self, policy) -> str | None:
        """Why this policy's model cannot be loaded, or None."""
        return None

    def version(self) -> str | None:
        return None

    def base_url(self, policy) -> str:
        host = policy.service["host"]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{policy.service['port']}"

    # ---- proof -----------------------------------------------------------
    completion_extra: dict = {"return_token_ids": True}  # more request fields this engine's completions ask for

    def completion(self, policy, prompt, max_tokens: int, timeout: float = 60.0, base: str | None = None,
                   extra: dict | None = None, canary: bool = False) -> dict:
        """A greedy completion from the engine at `base` (default: the service's own URL); `extra`: the
        fields beyond the standard ones (default: completion_extra); `canary`: marked as restartkit's
        canary (CANARY_HEADER), which an engine that batches runs in a batch of its own."""
        body = {"model": self.served_name(policy), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, **(self.completion_extra if extra is None else extra)}
        headers = {**self.auth_headers(policy), **({CANARY_HEADER: "1", **self.admin_headers(policy)} if canary else {})}
        url = base or self.base_url(policy)
        try:
            return http.post(url + "/v1/completions", body, timeout=timeout, headers=headers or None)
        except http.HTTPFailure as e:
            # an engine started with a name of its own (--served-model-name in a command): the one it serves
            if e.status != 404 or policy.service["served_model_name"] or not (name := self.listed_name(policy, url)):
                raise
            return http.post(url + "/v1/completions", {**body, "model": name}, timeout=timeout,
                             headers=headers or None)

    def listed_name(self, policy, base: str) -> str | None:
        """The first model the engine at `base` lists on /v1/models (None: it lists none, or cannot say)."""
        try:
            listed = http.request("GET", base + "/v1/models", timeout=5.0, headers=self.auth_headers(policy) or None)
            return str(listed["data"][0]["id"])
        except (http.HTTPFailure, OSError, KeyError, IndexError, TypeError, ValueError):
            return None

    # the environment variable through which the engine takes its API key (None: this adapter gives none)
    api_key_env: str | None = None

    def auth_headers(self, policy) -> dict:
        key = api_key(policy)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def admin_headers(self, policy) -> dict:
        """What restartkit's admin calls carry: the service's admin token (restartkit.guard.admin), and the API key."""
        from restartkit.guard import admin
        return {**self.auth_headers(policy), **admin.headers(policy.state_dir())}

    def key_problem(self, policy) -> str | None:
        """Why the policy's API key cannot be given to this engine (None: it can, or there is none)."""
        try:
            self.key_env(policy)
        except RuntimeError as e:
            return str(e)
        return None

    def key_env(self, policy) -> dict:
        """The engine's environment entry for the policy's API key ({} without one)."""
        key = api_key(policy)
        if key and self.api_key_env is None:
            raise RuntimeError(f"[service] api_key_file is set, but restartkit cannot give the {self.label} an API "
                               "key: set the engine's own flag in engine_args and leave api_key_file out")
        return {self.api_key_env: key} if key else {}

    def probe(self, policy, timeout: float = 30.0) -> None:
        """Ready means a real completion answered, not a 200 from /health."""
        out = self.completion(policy, "ready?", 1, timeout=timeout)
        if not out.get("choices"):
            raise RuntimeError("completion answered without choices")

    health_path = "/health"

    def health(self, policy, timeout: float = 3.0) -> None:
        """Liveness: the engine's health endpoint answers 2xx (cheap; a real completion is `probe`)."""
        http.get(self.base_url(policy) + self.health_path, timeout=timeout)

    def canary(self, policy, base: str | None = None) -> list[list[int]]:
        """Greedy completions of the policy's fixed prompts, as token ids (see canary_kind); `base`: ask the
        engine there (a standby's private port) instead of the service's."""
        r = policy.restart
        result = []
        for prompt in r["canary_prompts"]:
            choice = self.completion(policy, prompt, r["canary_max_tokens"], base=base, canary=True)["choices"][0]
            tokens = choice.get("token_ids")
            if tokens is None:
                raise RuntimeError("the engine does not return token ids; the canary cannot compare tokens")
            result.append(list(tokens))
        return result

    def stats(self, policy, timeout: float = 10.0) -> dict:
        return {}

    def feature_problems(self, policy) -> dict[str, str | None]:
        """Why each optional feature (ipc, sleep) is not available with this engine here (None: available)."""
        return {}

    # ---- capabilities ------------------------------------------------------
    # whose weight cache the ipc strategy attaches from: "restartkit" (restartkit's daemons, asked over
    # their sockets) or "engine" (the engine's own, e.g. `vllm preload`, seen through [ipc] health_port)
    weight_cache = "engine"
    ipc_proof_in_log = False  # does the engine say hit or fallback only in its log (see ipc_log_verdict)?

    def weight_cache_of(self, policy) -> str:
        """Whose weight cache this policy's engine attaches from (see weight_cache)."""
        return self.weight_cache

    def standby_problem(self, policy) -> str | None:
        """Why no standby of this engine can be held for this policy (None: one can)."""
        return (f"the {self.name} adapter has no prepare-only mode (deferred KV cache and port) restartkit can "
                "hold a standby in; see the README")

    def ipc_log_verdict(self, policy, text: str) -> dict:
        """{"ipc": "hit" | "fallback" | "mixed" | "unknown", "ranks": [...], "summary": str} from the log."""
        raise NotImplementedError(f"the {self.name} adapter reports its weight source in its stats")

    def overlap_problem(self, policy) -> str | None:
        """Why a new engine cannot be prepared beside the old one (an overlapped or prestarted
        ipc restart), or None when it can."""
        return "not supported by this engine adapter"

    def plan_notes(self, policy) -> list[str]:
        """What `plan` should say about this engine beyond the strategies' reasons."""
        return []

    # a signal that makes the engine write every thread's stack to its log without stopping it (a
    # restored engine that hangs is asked for them before it is killed); None: the engine has none
    stack_signal: int | None = None

    # can the engine let go of the weights it maps from the weight cache before a dump, and map them
    # again after (a weights-less snapshot, restored by the criu+ipc strategy)?
    weightless_snapshots = False

    def weightless_problem(self, policy) -> str | None:
        """Why this service's engine cannot release its weights before a dump (None: it can)."""
        if not self.weightless_snapshots:
            return f"the {self.name} adapter cannot release its weights before a dump"
        return None

    # can the engine give up the service's held socket before a dump and take it back after, serving
    # restartkit's admin calls on a private port meanwhile (restartkit.reference.serving.detach)?
    detaches_listener = False

    def detach_listener(self, policy) -> str:
        """Make the engine close its copy of the held socket; returns the base URL of the private port
        it serves admin calls on until it is sent SIGUSR2 (then it takes the socket back from `broker`)."""
        raise NotImplementedError(f"the {self.name} adapter cannot give up a held socket")

    def before_snapshot(self, policy, weights: bool = False, base: str | None = None) -> dict:
        """Shrink the process before a dump (free the KV cache; with `weights`, let go of the
        weights mapped from the weight cache too); returns what it did.  `base`: the engine's URL when
        not the service's (its private port, detach_listener)."""
        if weights:
            raise NotImplementedError(f"the {self.name} adapter cannot release its weights before a dump")
        return {}

    def after_resume(self, policy, timeout: float = 120.0, weights: bool = False, base: str | None = None) -> dict:
        """Undo before_snapshot once the process runs again (after a dump or a restore); with
        `weights`, map the weights from the weight cache again, a missing cache being an error.
        Returns how the weights came back (the engine's load info), {} without `weights`."""
        return {}

    def served_name(self, policy) -> str:
        return policy.service["served_model_name"] or self.default_served_name(policy)

    def default_served_name(self, policy) -> str:
        return policy.service["model"]

    # ---- sleep mode: vLLM's HTTP interface, which the reference engine speaks too --------
    sleep_needs_reload = False  # after level 2, must restartkit ask for the weights again?
    can_confirm_sleep = True  # does the engine answer "are you asleep?"

    def sleep_request(self, policy, level: int) -> dict:
        return http.post(f"{self.base_url(policy)}/sleep?level={int(level)}", timeout=300,
                         headers=self.admin_headers(policy))

    def sleep_is_confirmed(self, policy) -> bool:
        return bool(http.get(f"{self.base_url(policy)}/is_sleeping", timeout=10,
                             headers=self.admin_headers(policy)).get("is_sleeping"))

    def wake_request(self, policy, tags: list[str]) -> dict:
        query = "&".join(f"tags={t}" for t in tags)
        return http.post(f"{self.base_url(policy)}/wake_up?{query}", timeout=600, headers=self.admin_headers(policy))

    def wake_is_complete(self, answer: dict) -> bool:
        return answer.get("status") == "awake"

    def reload_weights(self, policy) -> None:
        raise NotImplementedError(f"the {self.name} adapter has no weight reload")

    def sleep_expected_bytes(self, policy, answer: dict) -> int | None:
        """What a sleep should free from the engine's processes, if known."""
        return None

    def sleep_state(self, policy, pid: int | None) -> dict:
        """{"enabled": bool, "asleep": bool | None, "level": int | None, "why": str} of the running engine."""
        return {"enabled": False, "asleep": None, "level": None, "why": f"the {self.name} adapter has no sleep mode"}


def api_key(policy) -> str | None:
    """The API key in [service] api_key_file (None without one); an unreadable or empty file is an error naming it."""
    path = policy.service.get("api_key_file") or ""
    if not path:
        return None
    try:
        key = open(path, encoding="utf-8").read().strip()
    except (OSError, UnicodeError) as e:
        raise RuntimeError(f"[service] api_key_file {path}: cannot read it ({getattr(e, 'strerror', None) or e}); "
                           "write the key in it, readable by restartkit's user only (chmod 600)") from None
    if not key or any(c.isspace() for c in key):
        raise RuntimeError(f"[service] api_key_file {path}: it must hold one key, without spaces")
    return key


def canary_kind(canary) -> str:
    """What a canary compares: "token ids", "logprob tokens" (a server that gives no ids) or "text"."""
    first = next((t for prompt in canary or [] for t in prompt), None)
    if isinstance(first, str) and first.startswith("text:"):
        return "text"
    return "logprob tokens" if isinstance(first, str) else "token ids"


def python() -> str:
    return sys.executable


def tree_cmdline(pid: int) -> str:
    """The command lines of a process and its descendants, joined ("" when it is gone):
    how an engine was really started, whatever restartkit's policy says now."""
    import psutil

    from restartkit.process.procfs import tree_pids
    out = []
    for p in tree_pids(pid):
        try:
            out.append(" ".join(psutil.Process(p).cmdline()))
        except psutil.Error:
            pass
    return " ".join(out)
