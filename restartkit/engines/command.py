"""Any OpenAI-compatible server started by a command: `[service] engine = "command"`
and `command = ["my-server", "--model", "{model}", "--port", "{port}"]`.

Placeholders: {model}, {host}, {port}, {max_model_len}, {tensor_parallel_size},
{served_model_name}.  restartkit knows nothing else of the engine: readiness is a
real completion with the standard fields only (a strict server refuses others), the canary
compares token ids when the server returns them, else the tokens of its logprobs, else the
text (the record says which: proof.canary.compared_by), and of
the fast paths only criu applies (it snapshots any process tree).
"""
from __future__ import annotations

import os
import shutil

from restartkit.engines.base import EngineAdapter, LaunchSpec

PLACEHOLDERS = ("model", "host", "port", "max_model_len", "tensor_parallel_size", "served_model_name")


# what the canary asks for, richest first: a server that refuses a field (400, 422) is asked without it
CANARY_FORMS = ({"return_token_ids": True, "logprobs": 1}, {"logprobs": 1}, {})


class CommandAdapter(EngineAdapter):
    name = "command"
    completion_extra = {}  # the readiness probe: the standard fields only, which a strict server accepts
    _form: dict | None = None  # the first of CANARY_FORMS this server accepted

    def _values(self, policy) -> dict:
        s = policy.service
        return {"model": s["model"], "host": s["host"], "port": s["port"], "max_model_len": s["max_model_len"],
                "tensor_parallel_size": s["tensor_parallel_size"], "served_model_name": self.served_name(policy)}

    def launch(self, policy, extra_args=()) -> LaunchSpec:
        values = self._values(policy)
        try:
            argv = [a.format(**values) for a in policy.service["command"]]
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"[service] command has a placeholder restartkit does not know ({e}); "
                             f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}") from None
        return LaunchSpec(argv=argv + list(policy.service["engine_args"]) + list(extra_args),
                          env=dict(policy.service["env"]))

    def model_problem(self, policy) -> str | None:
        cmd = policy.service["command"]
        if not cmd:
            return "[service] command is empty: give the engine's argv"
        exe = cmd[0]
        if os.sep in exe:
            if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
                return f"[service] command[0] {exe!r} is not an executable file"
        elif shutil.which(exe) is None:
            return f"[service] command[0] {exe!r} is not on PATH ({os.environ.get('PATH', '')})"
        try:
            self.launch(policy)
        except ValueError as e:
            return str(e)
        return None

    def version(self) -> str | None:
        return None

    def feature_problems(self, policy) -> dict[str, str | None]:
        return {"ipc": "a generic command engine has no loader for restartkit's weight cache",
                "sleep": "a generic command engine has no sleep interface restartkit knows"}

    def canary(self, policy, base: str | None = None) -> list[list]:
        r = policy.restart
        return [canary_tokens(self._canary_completion(policy, p, r["canary_max_tokens"], base)["choices"][0])
                for p in r["canary_prompts"]]

    def _canary_completion(self, policy, prompt, max_tokens: int, base: str | None = None) -> dict:
        from restartkit.http import HTTPFailure
        forms = [self._form] if self._form is not None else list(CANARY_FORMS)
        for i, form in enumerate(forms):
            try:
                out = self.completion(policy, prompt, max_tokens, base=base, extra=form, canary=True)
            except HTTPFailure as e:
                if e.status in (400, 422) and i + 1 < len(forms):
                    continue  # a field it does not take (a vLLM extension, logprobs): ask with less
                raise
            self._form = form
            return out
        raise AssertionError("unreachable")


def canary_tokens(choice: dict) -> list:
    """The most exact thing the server gave: token ids, else its logprobs' tokens, else the text."""
    if choice.get("token_ids") is not None:
        return list(choice["token_ids"])
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens:
        return ["tok:" + t for t in tokens]
    return ["text:" + (choice.get("text") or "")]
