"""SGLang: `python -m sglang.launch_server`.  NOT verified against a running
SGLang here (none is installable on these machines); the shape follows its
documented interfaces: /health_generate runs a real one-token generation,
`--weight-cache-mode client` attaches to a standalone daemon, and
/release_memory_occupation + /resume_memory_occupation (with
--enable-memory-saver) are its sleep."""
from __future__ import annotations

from importlib import metadata

from restartkit import http
from restartkit.engines.base import EngineAdapter, LaunchSpec, python


class SGLangAdapter(EngineAdapter):
    name = "sglang"
    verified = False

    def version(self) -> str | None:
        try:
            return metadata.version("sglang")
        except metadata.PackageNotFoundError:
            return None

    def launch(self, policy, extra_args=()) -> LaunchSpec:
        s = policy.service
        argv = [python(), "-m", "sglang.launch_server", "--model-path", s["model"], "--host", s["host"],
                "--port", str(s["port"]), "--tp-size", str(s["tensor_parallel_size"]),
                "--context-length", str(s["max_model_len"])]
        if s["revision"]:
            argv += ["--revision", s["revision"]]
        if policy.sleep["enabled"]:
            argv.append("--enable-memory-saver")
        return LaunchSpec(argv=argv + list(s["engine_args"]) + list(extra_args), env=dict(s["env"]))

    def model_problem(self, policy) -> str | None:
        return None if self.version() else "SGLang is not installed in restartkit's Python (pip install sglang)"

    def probe(self, policy) -> None:
        http.get(self.base_url(policy) + "/health_generate", timeout=60)

    def feature_problems(self, policy) -> dict[str, str | None]:
        note = " (the SGLang adapter was not verified against a running SGLang)"
        return {"ipc": "the SGLang weight cache (--weight-cache-mode client) is not driven by restartkit yet" + note,
                "sleep": "SGLang's /release_memory_occupation is not driven by restartkit yet" + note}

    def ipc_args(self, policy) -> list[str]:
        return ["--weight-cache-mode", "client"]

    def before_snapshot(self, policy) -> dict:
        return {}

    def after_resume(self, policy) -> None:
        return None
