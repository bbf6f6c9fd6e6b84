"""The memory a reference engine runs in: the device's size, and freed host memory given back to the kernel."""
from __future__ import annotations

import torch


def device_memory(device: torch.device) -> int:
    """All of the device's memory in bytes (the host's on the CPU); 0 where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def trim_heap() -> None:
    """glibc's malloc_trim: free heap pages returned to the kernel (elsewhere: nothing)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
