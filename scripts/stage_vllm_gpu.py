"""Stage vLLM 0.26.0 for the lent H200 (torch 2.11.0+cu130, Python 3.12: the newest vLLM whose PyPI wheel is built
for exactly that torch; see docs/engines.md), in pieces the device tool carries (at most 64 MiB a call).

  build    (a CPU machine with the package index): the vLLM wheel and the small packages the image lacks, found
           by walking vLLM's requirements (the image's own packages and the heavy optional kernels left out),
           installed for Python 3.12 into one tree, trimmed, packed as one tar.xz and split into pieces of at
           most 60 MiB under the ignored folders .vx0, .vx1, ... with the whole file's sha256 in .vx0/SHA256.
  install  (on the device, from the repository root once every piece travelled): the pieces joined and
           checked against SHA256, unpacked with Python's lzma and tarfile into SITE, and a `vllm` command in
           SITE/bin.  Prints the PYTHONPATH and PATH to export.

    python3 scripts/stage_vllm_gpu.py build [--work /var/tmp/vstage]
    python3 scripts/stage_vllm_gpu.py keep        (each call that carries a piece: it outlives the call's tree)
    python3 scripts/stage_vllm_gpu.py install [--site /tmp/vsite]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM = "vllm==0.26.0"
PIECE = 60 << 20
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
            *[a for n in (39, 35, 34, 31, 28, 27, 24, 17, 12, 5) for a in ("--platform", f"manylinux_2_{n}_x86_64")],
            "--platform", "manylinux2014_x86_64", "--platform", "manylinux2010_x86_64", "--platform",
            "manylinux1_x86_64", "--platform", "linux_x86_64", "--platform", "any"]
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# on the device's image already (its package list, .library/device/KINDS.md): kept at the image's versions
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp""".split())
# heavy, and not imported on a plain Llama `vllm serve` path (FA3 on sm_90; VLLM_USE_FLASHINFER_SAMPLER=0)
SKIP = {"flashinfer-python", "flashinfer-cubin", "tilelang", "z3-solver", "pynvvideocodec", "tokenspeed-mla",
        "quack-kernels", "humming-kernels", "torchcodec", "fastsafetensors", "nvtx", "nvidia-cutlass-dsl",
        "nvidia-cudnn-frontend"}
# where vLLM's own pin conflicts with a package it needs (vLLM pins apache-tvm-ffi 0.1.10 for flashinfer, left out;
# the xgrammar it takes needs 0.1.11 or newer): seen on the H200
OVERRIDE = {"apache-tvm-ffi": "apache-tvm-ffi>=0.1.11"}
TRIM = ["bin", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "xgrammar/lib/libxgrammar.a"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path, extras: set[str]) -> list:
    from packaging.requirements import Requirement
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or any(req.marker.evaluate({**MARKERS, "extra": e}) for e in (extras or {""})):
            out.append(req)
    return out


def download(spec: str, wheels: Path) -> Path:
    before = set(wheels.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM,
                    "-d", str(wheels), spec], check=True)
    new = set(wheels.glob("*.whl")) - before
    name = norm(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0])
    return next(iter(new)) if new else next(w for w in wheels.glob("*.whl") if norm(w.name.split("-")[0]) == name)


def resolve(wheels: Path) -> list[Path]:
    """vLLM's wheel and every requirement it pulls in that the image lacks (breadth first).  Extras are followed
    wherever they are asked for, also of a package taken already (mistral_common asks pydantic-extra-types for
    [pycountry] after another package took it plain: the first staging missed pycountry)."""
    got = {"vllm": download(VLLM, wheels)}
    extras_of: dict[str, set[str]] = {"vllm": set()}
    queue = [(r, set(r.extras)) for r in requirements(got["vllm"], set())]
    while queue:
        req, extras = queue.pop(0)
        name = norm(req.name)
        if name in IMAGE or name in SKIP:
            continue
        if name in got:
            if new := extras - extras_of[name]:  # the same package, with more of its extras asked for
                extras_of[name] |= new
                queue += [(r, set(r.extras)) for r in requirements(got[name], new) if r.marker is not None]
            continue
        spec = OVERRIDE.get(name, f"{req.name}{req.specifier}")
        print(f"  {spec}", flush=True)
        got[name], extras_of[name] = download(spec, wheels), set(extras)
        queue += [(r, set(r.extras)) for r in requirements(got[name], extras)]
    return list(got.values())


def build(args) -> int:
    work = Path(args.work)
    wheels, site = work / "wheels", work / "site"
    wheels.mkdir(parents=True, exist_ok=True)
    chosen = resolve(wheels)
    print(f"{len(chosen)} wheels, {sum(w.stat().st_size for w in chosen) / 2**20:.0f} MiB")
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(site), *PLATFORM, *map(str, chosen)], check=True)
    for rel in TRIM:
        p = site / rel
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for p in list(site.rglob("__pycache__")):
        shutil.rmtree(p, ignore_errors=True)
    (site / "STAGED.json").write_text(json.dumps(sorted(w.name for w in chosen), indent=1))
    archive = work / "vllm-site.tar.xz"
    print("packing (xz -9) ...", flush=True)
    tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
    with open(archive, "wb") as f:
        subprocess.run(["xz", "-9", f"-T{args.threads}", "-c"], stdin=tar.stdout, stdout=f, check=True)
    tar.wait()
    data = archive.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), PIECE):
        d = ROOT / f".vx{i // PIECE}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / "piece").write_bytes(data[i:i + PIECE])
        if f"/{d.name}/" not in (exclude.read_text() if exclude.exists() else ""):
            with open(exclude, "a") as f:
                f.write(f"/{d.name}/\n")
    (ROOT / ".vx0" / "SHA256").write_text(f"{digest} {len(data)} {(len(data) + PIECE - 1) // PIECE}\n")
    print(f"{archive}: {len(data)} bytes, sha256 {digest}, {(len(data) + PIECE - 1) // PIECE} pieces in .vx0..")
    return 0


def install(args) -> int:
    import lzma
    # each piece from its .vxN folder, or from --pieces where an earlier call put it (a call's tree replaces the
    # last one's, ignored folders included: `keep` copies each piece out as it comes)
    def find(i: int, name: str) -> Path:
        here = ROOT / f".vx{i}" / name
        return here if here.exists() else Path(args.pieces) / f"{i}.{name}"
    digest, size, pieces = find(0, "SHA256").read_text().split()
    data = b"".join(find(i, "piece").read_bytes() for i in range(int(pieces)))
    if len(data) != int(size) or hashlib.sha256(data).hexdigest() != digest:
        print(f"the pieces joined are {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}: not the "
              f"archive staged ({size} bytes, {digest}); carry every .vx folder again", file=sys.stderr)
        return 2
    site = Path(args.site)
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data))) as tar:
        tar.extractall(site, filter="data")
    (site / "bin").mkdir(exist_ok=True)
    shim = site / "bin" / "vllm"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m vllm.entrypoints.cli.main "$@"\n')
    shim.chmod(0o755)
    print(f"export PYTHONPATH={site}:{ROOT}${{PYTHONPATH:+:$PYTHONPATH}} PATH={site}/bin:$PATH "
          "VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--work", default="/var/tmp/vstage")
    b.add_argument("--threads", type=int, default=1, help="xz threads (1: leave a core to whatever else runs)")
    i = sub.add_parser("install")
    i.add_argument("--site", default="/tmp/vsite")
    i.add_argument("--pieces", default="/var/tmp/vllm-pieces")
    k = sub.add_parser("keep", help="copy the .vxN pieces this call carried to --pieces (outside the tree)")
    k.add_argument("--pieces", default="/var/tmp/vllm-pieces")
    args = p.parse_args()
    return {"build": build, "install": install, "keep": keep}[args.cmd](args)


def keep(args) -> int:
    out = Path(args.pieces)
    out.mkdir(parents=True, exist_ok=True)
    for d in sorted(ROOT.glob(".vx*")):
        for f in d.iterdir():
            shutil.copy(f, out / f"{d.name[3:]}.{f.name}")
    print(sorted(p.name for p in out.iterdir()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
