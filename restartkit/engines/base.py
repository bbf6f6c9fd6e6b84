"""What restartkit needs to know about an engine, one adapter per engine."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from restartkit import http


@dataclass
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]


class EngineAdapter:
    name = "base"

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
    def completion(self, policy, prompt, max_tokens: int, timeout: float = 60.0) -> dict:
        body = {"model": self.served_name(policy), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True}
        return http.post(self.base_url(policy) + "/v1/completions", body, timeout=timeout)

    def probe(self, policy) -> None:
        """Ready means a real completion answered, not a 200 from /health."""
        out = self.completion(policy, "ready?", 1, timeout=30.0)
        if not out.get("choices"):
            raise RuntimeError("completion answered without choices")

    def canary(self, policy) -> list[list[int]]:
        """Greedy completions of the policy's fixed prompts, as token ids."""
        r = policy.restart
        result = []
        for prompt in r["canary_prompts"]:
            choice = self.completion(policy, prompt, r["canary_max_tokens"])["choices"][0]
            tokens = choice.get("token_ids")
            if tokens is None:
                raise RuntimeError("the engine does not return token ids; the canary cannot compare tokens")
            result.append(list(tokens))
        return result

    def stats(self, policy) -> dict:
        return {}

    def feature_problems(self, policy) -> dict[str, str | None]:
        """Why each optional feature (ipc, sleep) is not available with this engine here (None: available)."""
        return {}

    def before_snapshot(self, policy) -> dict:
        """Shrink the process before a dump (e.g. free the KV cache); returns what it did."""
        return {}

    def after_resume(self, policy) -> None:
        """Undo before_snapshot once the process runs again (after a dump or a restore)."""
        return None

    def served_name(self, policy) -> str:
        return policy.service["model"]


def python() -> str:
    return sys.executable
