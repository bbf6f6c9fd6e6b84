"""`restartkit rollout`: bring a service onto its weight cache, proving it.

1. the weight cache first: started (detached) unless it already serves;
2. an ipc restart with fallback off: the engine must attach from the cache
   on every rank, or that restart fails and recovers cold — a silent disk
   load cannot pass for a working cache;
3. an ipc restart with the policy's own fallback setting, which is how the
   service runs from then on.
"""
from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

from restartkit import http
from restartkit.errors import StrategyError
from restartkit.restart import restart
from restartkit.service import Service


SERVE_ONLY = {"--host": 1, "--port": 1, "--enable-sleep-mode": 0}  # flag -> how many values follow it


def vllm_preload_argv(policy) -> list[str]:
    """`vllm preload` with the engine's own arguments (vLLM's preload takes the same engine
    arguments as `vllm serve`, so the daemons' fingerprint matches what the engine will ask for),
    the socket directory when the policy names one, and its health endpoint on loopback."""
    from restartkit.engines.vllm import VLLMAdapter
    engine, skip = [], 0
    for a in VLLMAdapter().launch(policy).argv[3:]:
        if skip:
            skip -= 1
        elif a in SERVE_ONLY:
            skip = SERVE_ONLY[a]
        else:
            engine.append(a)
    i = policy.ipc
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "preload", *engine,
            "--weight-cache-health-host", i["health_host"], "--weight-cache-health-port", str(i["health_port"])]
    if i["socket_dir"]:
        argv += ["--weight-cache-socket-dir", i["socket_dir"]]
    if i["nnodes"] > 1:
        argv += ["--nnodes", str(i["nnodes"]), "--node-rank", str(i["node_rank"]), "--master-addr", i["master_addr"],
                 "--weight-cache-master-port", str(i["weight_cache_master_port"])]
    return argv


def ensure_cache(service: Service, say) -> str:
    pol = service.policy
    if service.adapter.weight_cache_of(pol) == "restartkit":  # restartkit's daemons (vLLM: its plugin's load format)
        from restartkit.weightcache.client import daemon_stats
        if all(d.get("state") == "ready" for d in daemon_stats(pol)):
            return "the weight cache was already serving"
        from restartkit.weightcache.prelaunch import start_weight_cache
        rc = start_weight_cache(pol, say)
        if rc:
            raise StrategyError(f"the weight cache did not start (exit {rc})", hint=f"see {service.state_dir}/weightcache.log")
        return "started the weight cache"
    if pol.service["engine"] == "vllm":  # vLLM's own weight cache: [ipc] health_port set
        i = pol.ipc
        url = f"http://{i['health_host']}:{i['health_port']}/health"
        try:
            http.get(url, timeout=3)
            return "vllm preload was already serving"
        except http.HTTPFailure:
            pass
        service.ensure_state_dir()
        log_path = service.state_dir / "vllm-preload.log"
        with open(log_path, "ab") as log:
            offset = log.tell()
            proc = subprocess.Popen(vllm_preload_argv(pol), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        def healthy() -> bool:
            try:
                http.get(url, timeout=3)
                return True
            except http.HTTPFailure:
                pass
            if proc.poll() is not None:
                with open(log_path, "rb") as f:
                    f.seek(offset)
                    tail = f.read().decode(errors="replace").strip().splitlines()[-3:]
                raise StrategyError(f"vllm preload exited with code {proc.returncode} before it was healthy: "
                                    + (" | ".join(tail) or "no output"),
                                    hint=f"see {log_path}; `vllm preload` needs vLLM 0.31 or newer on CUDA/ROCm")
            return False
        if service.seam.wait_until(healthy, i["startup_timeout_s"], 0.5):
            return f"started vllm preload (PID {proc.pid})"
        proc.terminate()
        raise StrategyError(f"vllm preload was not healthy at {url} within {i['startup_timeout_s']:.0f} s",
                            hint=f"see {service.state_dir}/vllm-preload.log")
    raise StrategyError(f"rollout does not know how to start the {pol.service['engine']} weight cache")


def rollout(service: Service, say) -> list:
    say(ensure_cache(service, say))
    strict = dataclasses.replace(service.policy, sections=copy.deepcopy(service.policy.sections))
    strict.sections["ipc"]["fallback"] = False
    say("restart 1/2: ipc with fallback off (the cache must really serve)")
    first = restart(Service(strict), "ipc", "restart", strict=True, say=say)
    if first.served_by != "ipc" or first.via_recovery:
        say("the cache did not serve: the service runs on its recovery path; the policy's own setting is not rolled out")
        return [first]
    say(f"restart 2/2: ipc with the policy's own setting (fallback = {str(service.policy.ipc['fallback']).lower()})")
    return [first, restart(service, "ipc", "restart", strict=True, say=say)]
