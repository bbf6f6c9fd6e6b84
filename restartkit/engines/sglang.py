"""SGLang: `python -m sglang.launch_server`.  NOT verified against a running
SGLang here (none is installable on these machines); the shape follows its
documented interfaces: /health_generate runs a real one-token generation,
`--weight-cache-mode client` attaches to a standalone daemon, and
/release_memory_occupation + /resume_memory_occupation (with
--enable-memory-saver) are its sleep."""
from __future__ import annotations

from importlib import metadata

from restartkit import http
from restartkit.engines.base import EngineAdapter, LaunchSpec, local_model_problem, python, tree_cmdline


class SGLangAdapter(EngineAdapter):
    name = "sglang"
    label = "SGLang"

    def overlap_problem(self, policy) -> str | None:
        return "SGLang's interfaces have no prepare/activate split"
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
            if policy.sleep["level"] == 1:  # level 1 parks the weights in host memory instead of dropping them
                argv.append("--enable-weights-cpu-backup")
        return LaunchSpec(argv=argv + list(s["engine_args"]) + list(extra_args), env=dict(s["env"]))

    def model_problem(self, policy) -> str | None:
        if not self.version():
            return "SGLang is not installed in restartkit's Python (pip install sglang)"
        return local_model_problem(policy.service["model"])

    def probe(self, policy, timeout: float = 60.0) -> None:
        http.get(self.base_url(policy) + "/health_generate", timeout=timeout)

    def feature_problems(self, policy) -> dict[str, str | None]:
        note = " (the SGLang adapter was not verified against a running SGLang)"
        return {"ipc": "the SGLang weight cache (--weight-cache-mode client) is not driven by restartkit yet" + note,
                "sleep": None if policy.sleep["enabled"] else
                "set [sleep] enabled = true: SGLang then starts with --enable-memory-saver" + note}

    def plan_notes(self, policy) -> list[str]:
        return ["the SGLang adapter follows SGLang's documented interfaces and was NOT run against a running SGLang "
                "here: cold start and /health_generate readiness, and sleep through /release_memory_occupation and "
                "/resume_memory_occupation (no /is_sleeping: proof by memory and canary only), are unverified"]

    # ---- sleep: /release_memory_occupation and /resume_memory_occupation, JSON bodies with tags ----
    sleep_needs_reload = True  # a level-2 cycle reloads through /update_weights_from_disk
    can_confirm_sleep = False  # SGLang has no /is_sleeping

    def sleep_request(self, policy, level: int) -> dict:
        return http.post(self.base_url(policy) + "/release_memory_occupation", {}, timeout=300) or {}

    def wake_request(self, policy, tags: list[str]) -> dict:
        return http.post(self.base_url(policy) + "/resume_memory_occupation", {"tags": list(tags)}, timeout=600) or {}

    def wake_is_complete(self, answer: dict) -> bool:
        return answer.get("success", True) is not False

    def reload_weights(self, policy) -> None:
        answer = http.post(self.base_url(policy) + "/update_weights_from_disk",
                           {"model_path": policy.service["model"]}, timeout=900) or {}
        if answer.get("success") is False:
            raise http.HTTPFailure("/update_weights_from_disk", 200, str(answer.get("message"))[:300])

    def sleep_state(self, policy, pid: int | None) -> dict:
        if "--enable-memory-saver" not in (tree_cmdline(pid) if pid else ""):
            return {"enabled": False, "asleep": None, "level": None,
                    "why": "the running SGLang was started without --enable-memory-saver: set [sleep] enabled = true "
                           "and restart it once (cold)"}
        return {"enabled": True, "asleep": False, "level": None}

    def ipc_args(self, policy) -> list[str]:
        return ["--weight-cache-mode", "client"]
