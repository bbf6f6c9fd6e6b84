"""One contiguous arena per device holding every processed tensor, so an
engine attaches with one handle whatever the tensor count.

CPU: a memfd (anonymous shared memory file), passed with SCM_RIGHTS; the
engine maps it read-only in zero_copy mode, so an in-place write in one
engine faults instead of corrupting the weights every engine shares.
CUDA: one device allocation, shared as one CUDA IPC handle.

The manifest lists each tensor's name, dtype, shape, stride and byte offset.
"""
from __future__ import annotations

import base64
import mmap
import os
from dataclasses import dataclass, field

import torch

ALIGN = 256
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.int8: "int8", torch.uint8: "uint8", torch.int32: "int32", torch.int64: "int64"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Arena:
    device: torch.device
    nbytes: int
    data: torch.Tensor  # uint8 [nbytes]
    manifest: list[dict] = field(default_factory=list)
    memfd: int | None = None
    _mmap: mmap.mmap | None = None

    def handle(self) -> dict:
        """What travels to the engine (besides the fd, on CPU)."""
        if self.device.type == "cpu":
            return {"kind": "memfd", "nbytes": self.nbytes}
        share = self.data.untyped_storage()._share_cuda_()
        dev, h, size, offset, rc_h, rc_off, ev_h, ev_sync = share
        b64 = lambda b: base64.b64encode(b).decode() if b is not None else None  # noqa: E731
        return {"kind": "cuda_ipc", "nbytes": self.nbytes, "device": dev, "handle": b64(h), "size": size,
                "offset": offset, "ref_counter_handle": b64(rc_h), "ref_counter_offset": rc_off,
                "event_handle": b64(ev_h), "event_sync_required": ev_sync}

    def close(self) -> None:
        self.data = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # views still exported; the memory goes when they do
                pass
            self._mmap = None
        if self.memfd is not None:
            os.close(self.memfd)
            self.memfd = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def plan_layout(named_meta: list[tuple[str, torch.dtype, tuple]]) -> tuple[list[dict], int]:
    manifest, offset = [], 0
    for name, dtype, shape in named_meta:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        stride = []
        acc = 1
        for d in reversed(shape):
            stride.insert(0, acc)
            acc *= d
        manifest.append({"name": name, "dtype": DTYPE_NAMES[dtype], "shape": list(shape), "stride": stride,
                         "offset": offset, "nbytes": nbytes})
        offset = _align(offset + nbytes)
    return manifest, max(offset, ALIGN)


def allocate(device: torch.device, nbytes: int, name: str = "restartkit-arena") -> Arena:
    if device.type == "cpu":
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        data = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        return Arena(device, nbytes, data, memfd=fd, _mmap=mm)
    return Arena(device, nbytes, torch.empty(nbytes, dtype=torch.uint8, device=device))


def pack(tensors: list[tuple[str, torch.Tensor]], device: torch.device) -> Arena:
    """Copy processed tensors into a new arena (they may then be freed)."""
    manifest, total = plan_layout([(n, t.dtype, tuple(t.shape)) for n, t in tensors])
    arena = allocate(device, total)
    for entry, (_, t) in zip(manifest, tensors):
        view_of(arena.data, entry).copy_(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    arena.manifest = manifest
    return arena


def view_of(data: torch.Tensor, entry: dict) -> torch.Tensor:
    raw = data[entry["offset"] : entry["offset"] + entry["nbytes"]]
    return raw.view(NAME_DTYPES[entry["dtype"]]).view(entry["shape"])


def to_wire(manifest: list[dict]) -> dict:
    """Columns, not one object per tensor: a tenth of the bytes to send and parse."""
    dtypes = sorted({e["dtype"] for e in manifest})
    code = {d: i for i, d in enumerate(dtypes)}
    return {"dtypes": dtypes, "names": [e["name"] for e in manifest], "dtype": [code[e["dtype"]] for e in manifest],
            "shape": [e["shape"] for e in manifest], "offset": [e["offset"] for e in manifest]}


def views(data: torch.Tensor, wire: dict) -> list[tuple[str, torch.Tensor]]:
    """Tensor views into the arena: one typed view of the whole arena per
    dtype, then one as_strided per tensor (offsets are 256-byte aligned)."""
    typed = []
    usable = data.numel()
    for name in wire["dtypes"]:
        dt = NAME_DTYPES[name]
        size = torch.empty((), dtype=dt).element_size()
        typed.append((data[: usable // size * size].view(dt), size))
    out = []
    for name, code, shape, offset in zip(wire["names"], wire["dtype"], wire["shape"], wire["offset"]):
        base, size = typed[code]
        stride, acc = [], 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= d
        out.append((name, base.as_strided(shape, stride[::-1], offset // size)))
    return out


def open_memfd(fd: int, nbytes: int, writable: bool) -> tuple[torch.Tensor, mmap.mmap]:
    """Map an arena received as a descriptor.  Read-only unless `writable`."""
    import warnings

    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that a read-only buffer is not writable: that is the point
        data = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    return data, mm


def open_cuda(h: dict) -> torch.Tensor:
    """Map the daemon's arena.  Its producer event is not waited on (event_sync_required False):
    the daemon synchronizes before it hands out any handle, and torch never destroys an event it
    opens over IPC: one left in the engine is an imported resource that the driver's checkpoint
    cannot carry (a weights-less snapshot's restore would stall on it)."""
    b = lambda s: base64.b64decode(s) if s is not None else None  # noqa: E731
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        h["device"], b(h["handle"]), h["size"], h["offset"], b(h["ref_counter_handle"]), h["ref_counter_offset"],
        b(h["event_handle"]) or b"", False)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{h['device']}").set_(storage, 0, (h["nbytes"],), (1,))
