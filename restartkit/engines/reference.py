"""The reference engine (restartkit.reference): our own small Llama server."""
from __future__ import annotations

import os
import signal

from restartkit import __version__, http
from restartkit.engines.base import EngineAdapter, LaunchSpec, python
from restartkit.reference.model.layout import draft_problem, model_dir_ok


# On the CPU, OpenMP's worker threads spin between torch operations by default (GNU OpenMP: 300,000 turns).  The
# engine's scheduler hands each step's tokens to its HTTP threads, which then wait for a core the spinning threads
# hold: measured on a 2-core VM, a 257-token completion took 1.3-1.8 s spinning and 0.5 s passive.  Passive threads
# sleep after every operation and take tens of microseconds to wake for the next: one stream of the tiny preset
# took 1.58 ms a token passive and 0.37 ms with 10,000 turns of spinning, and the small preset 4.6 and 2.4 ms
# (docs/BENCHMARKS.md).  [service] env overrides it.
CPU_ENV = {"GOMP_SPINCOUNT": "10000"}


class ReferenceAdapter(EngineAdapter):
    name = "reference"
    api_key_env = "RESTARTKIT_API_KEY"  # the reference engine's --api-key default
    waits_for_previous = True  # RESTARTKIT_AFTER_PID: allocates device memory only once its predecessor exited
    signals_ready = True  # RESTARTKIT_READY_FD: one byte when ready, then the pipe is closed
    serves_on_socket = True  # --listen-fd: serves on the service's held socket (restartkit.process.listener)
    label = "the reference engine"
    weight_cache = "restartkit"

    def overlap_problem(self, policy) -> str | None:
        if policy.service["tensor_parallel_size"] > 1:
            return ("an engine prepared beside the old one is built and tested at tensor_parallel_size 1 only "
                    "(two engines' ranks on the same devices at once are not)")
        return None

    def standby_problem(self, policy) -> str | None:
        if policy.ipc["mode"] != "zero_copy":
            return "a standby maps its weights from the weight cache: [ipc] mode must be 'zero_copy' (no second copy)"
        return None

    def launch(self, policy, extra_args=()) -> LaunchSpec:
        s = policy.service
        argv = [python(), "-m", "restartkit.reference.serving.server", "--model", s["model"],
                "--host", s["host"], "--port", str(s["port"]), "--device", s["device"],
                "--max-model-len", str(s["max_model_len"]), "--served-model-name", self.served_name(policy)]
        if s["dtype"] != "auto":
            argv += ["--dtype", s["dtype"]]
        if s["draft_model"]:
            argv += ["--draft-model", s["draft_model"], "--num-speculative-tokens", str(s["num_speculative_tokens"])]
        argv += ["--tensor-parallel-size", str(s["tensor_parallel_size"]), "--quantization", s["quantization"],
                 "--data-parallel-size", str(s["data_parallel_size"]), "--revision", s["revision"],
                 "--data-parallel-rank", str(policy.ipc["data_parallel_start_rank"])]
        if s["expert_parallel"]:
            argv.append("--enable-expert-parallel")
        if policy.sleep["enabled"]:
            argv.append("--enable-sleep-mode")
        if policy.restart["overlap"]:
            argv.append("--reuse-port")
        argv += list(s["engine_args"]) + list(extra_args)
        return LaunchSpec(argv=argv, env={**(CPU_ENV if s["device"] == "cpu" else {}), **s["env"],
                                          **self.key_env(policy)})

    def model_problem(self, policy) -> str | None:
        s = policy.service
        if problem := model_dir_ok(s["model"]):
            return problem
        return draft_problem(s["model"], s["draft_model"]) if s["draft_model"] else None

    def ipc_args(self, policy) -> list[str]:
        """Flags that make the engine load through the weight cache."""
        import json
        i = policy.ipc
        from restartkit.weightcache.loader import LOADER_KEYS
        cfg = {k: i[k] for k in LOADER_KEYS}
        return ["--load-format", "ipc_cache", "--ipc-config", json.dumps(cfg)]

    def version(self) -> str:
        return __version__

    def default_served_name(self, policy) -> str:
        return os.path.basename(os.path.normpath(policy.service["model"]))

    def stats(self, policy, timeout: float = 10.0) -> dict:
        return http.get(self.base_url(policy) + "/admin/stats", timeout=timeout, headers=self.admin_headers(policy))

    def feature_problems(self, policy) -> dict[str, str | None]:
        return {"ipc": None, "sleep": None}

    def sleep_expected_bytes(self, policy, answer: dict) -> int | None:
        return answer.get("weight_bytes", 0) + answer.get("kv_cache_bytes", 0)

    def sleep_state(self, policy, pid: int | None) -> dict:
        try:
            sleep = self.stats(policy).get("sleep") or {}
        except http.HTTPFailure as e:
            return {"enabled": False, "asleep": None, "level": None, "why": f"the engine does not answer: {e.message}"}
        if not sleep.get("enabled"):
            return {"enabled": False, "asleep": None, "level": None,
                    "why": "the running engine was started without sleep mode: set [sleep] enabled = true and restart it once (cold)"}
        return {"enabled": True, "asleep": bool(sleep.get("level")), "level": sleep.get("level") or None,
                "last": sleep.get("last") or {}}

    weightless_snapshots = True
    stack_signal = signal.SIGQUIT  # faulthandler, registered by the server

    detaches_listener = True

    def detach_listener(self, policy) -> str:
        port = http.post(self.base_url(policy) + "/admin/detach_listener", timeout=30,
                         headers=self.admin_headers(policy))["admin_port"]
        return f"http://127.0.0.1:{int(port)}"

    def before_snapshot(self, policy, weights: bool = False, base: str | None = None) -> dict:
        url, h = base or self.base_url(policy), self.admin_headers(policy)
        if weights:
            return http.post(url + "/admin/release_weights", timeout=60, headers=h)
        return {"kv_cache_freed_bytes": http.post(url + "/admin/drop_kv_cache", timeout=60, headers=h).get("freed_bytes", 0)}

    def after_resume(self, policy, timeout: float = 120.0, weights: bool = False, base: str | None = None) -> dict:
        url, h = base or self.base_url(policy), self.admin_headers(policy)
        if weights:
            return http.post(url + "/admin/reattach_weights", {"fallback": False}, timeout=timeout, headers=h).get("load") or {}
        http.post(url + "/admin/restore_kv_cache", timeout=timeout, headers=h)
        return {}
