"""How much memory one process holds, where its engine keeps its weights:
device memory through NVML on GPUs, resident set size on the CPU."""
from __future__ import annotations


def process_memory(pid: int, device: str) -> int | None:
    if device == "cuda":
        return _nvml_process_bytes(pid)
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss
    except Exception:
        return None


def _nvml_process_bytes(pid: int) -> int | None:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory:
                    total += p.usedGpuMemory
        return total
    finally:
        pynvml.nvmlShutdown()


def free_memory(device: str) -> int | None:
    """Free device memory (GPU 0 as NVML sees it) or available host memory."""
    if device == "cuda":
        try:
            import pynvml
            pynvml.nvmlInit()
            try:
                return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)
            finally:
                pynvml.nvmlShutdown()
        except Exception:
            return None
    from restartkit.facts import _meminfo
    return _meminfo()[1]


def tree_memory(pid: int, device: str) -> int | None:
    """The engine's memory: the process and every descendant (vLLM's engine
    core and workers are child processes of its API server)."""
    from restartkit.process.procfs import tree_pids
    values = [process_memory(p, device) for p in tree_pids(pid)]
    known = [v for v in values if v is not None]
    return sum(known) if known else None
