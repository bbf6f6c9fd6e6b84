"""The CUDA driver's checkpoint API on another process, through ctypes.

lock -> checkpoint moves the process's device memory to host memory and
releases its GPU (no /dev/nvidia* descriptors left, so CRIU can dump it);
restore -> unlock brings it back.  Only the driver (libcuda) is needed.
"""
from __future__ import annotations

import ctypes

from restartkit.process.procfs import maps

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class CudaCheckpointError(RuntimeError):
    pass


class CudaCheckpoint:
    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaCheckpointError(f"libcuda.so.1 is not loadable ({e}): no NVIDIA driver here") from None
        for name in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                     "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState"):
            if not hasattr(self.lib, name):
                raise CudaCheckpointError(f"the driver has no {name}: a driver with the checkpoint API (R550+) is needed")
        self._check(self.lib.cuInit(0), "cuInit")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise CudaCheckpointError(f"{what} failed with CUDA error {rc}")

    def state(self, pid: int) -> str:
        st = ctypes.c_int(-1)
        self._check(self.lib.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(st)), "cuCheckpointProcessGetState")
        return STATES.get(st.value, str(st.value))

    def lock(self, pid: int, timeout_ms: int = 30000) -> None:
        class LockArgs(ctypes.Structure):
            _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]
        self._check(self.lib.cuCheckpointProcessLock(ctypes.c_int(pid), ctypes.byref(LockArgs(timeout_ms))), "lock")

    def checkpoint(self, pid: int) -> None:
        self._check(self.lib.cuCheckpointProcessCheckpoint(ctypes.c_int(pid), None), "checkpoint")

    def restore(self, pid: int) -> None:
        self._check(self.lib.cuCheckpointProcessRestore(ctypes.c_int(pid), None), "restore")

    def unlock(self, pid: int) -> None:
        self._check(self.lib.cuCheckpointProcessUnlock(ctypes.c_int(pid), None), "unlock")


def uses_cuda(pid: int) -> bool:
    return any("libcuda.so" in line for line in maps(pid))
