"""The vLLM versions restartkit declares (0.26 through 0.33): every name it takes from vLLM is resolved in one
place (restartkit/engines/vllm_seams.py) by what the installed vLLM has.  Checked against vLLM 0.26.0's own
source (its sdist, fetched from the package index and pinned by its sha256; nothing of it is imported) and
against the CPU build installed here (0.32)."""
import ast
import hashlib
import os
import tarfile
import urllib.request
from pathlib import Path

import pytest

from restartkit.engines import vllm_seams
from tests.helpers import needs_vllm

SDIST = ("https://files.pythonhosted.org/packages/cd/72/fa30f8459d11ae206f1a20bd0ac7ed1b9e390b695fa3dfc9ef6056de0cfe/"
         "vllm-0.26.0.tar.gz")
SHA256 = "23e9fa19d7e20ce7dcc1c074d41503e2116d23f19e688f5d5ea91b741f958502"
# where 0.26 keeps what later releases moved (GPU-VLLM.md's study, checked here against the source)
IN_026 = {"build_app": "vllm.entrypoints.openai.api_server", "init_app_state": "vllm.entrypoints.openai.api_server",
          "build_async_engine_client": "vllm.entrypoints.openai.api_server",
          "create_server_socket": "vllm.entrypoints.openai.api_server", "serve_http": "vllm.entrypoints.launcher",
          "make_arg_parser": "vllm.entrypoints.openai.cli_args"}


def test_the_declared_range_is_checked_by_name():
    assert vllm_seams.version_problem("0.26.0") is None and vllm_seams.version_problem("0.33.1") is None
    assert vllm_seams.version_problem("0.32.0+cpu") is None
    for outside in ("0.25.2", "0.34.0", "1.0.0"):
        assert "outside the versions restartkit supports (0.26 through 0.33)" in vllm_seams.version_problem(outside)
    assert "cannot read" in vllm_seams.version_problem("nightly")


@pytest.fixture(scope="module")
def v026(tmp_path_factory) -> dict[str, set[str]]:
    """Each module of vLLM 0.26.0 and the names defined (or re-exported) at its top level."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "restartkit"
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / "vllm-0.26.0.tar.gz"
    if not sdist.exists() or hashlib.sha256(sdist.read_bytes()).hexdigest() != SHA256:
        part = sdist.with_suffix(".part")
        with urllib.request.urlopen(SDIST, timeout=120) as r, open(part, "wb") as f:
            f.write(r.read())
        assert hashlib.sha256(part.read_bytes()).hexdigest() == SHA256, "the sdist fetched is not vLLM 0.26.0's"
        part.rename(sdist)
    modules = {}
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if not m.isfile() or not m.name.endswith(".py") or len(parts) < 3 or parts[1] != "vllm":
                continue
            names = list(parts[1:])
            names[-1] = names[-1][:-3]
            if names[-1] == "__init__":
                names.pop()
            tree = ast.parse(tar.extractfile(m).read())
            defined = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined.add(node.name)
                elif isinstance(node, (ast.ImportFrom, ast.Import)):
                    defined.update((a.asname or a.name).split(".")[0] for a in node.names)
                elif isinstance(node, ast.Assign):
                    defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
            modules[".".join(names)] = defined
    return modules


@pytest.mark.slow  # fetches 38 MB once (then cached)
def test_every_seam_restartkit_resolves_exists_in_vllm_026(v026):
    found, missing = {}, []
    for name, (places, optional) in vllm_seams.SEAMS.items():
        where = next((mod for mod in places if name in v026.get(mod, set())), None)
        if where is None and not optional:
            missing.append(f"{name} (looked in {', '.join(places)})")
        found[name] = where
    assert missing == [], missing
    for name, where in IN_026.items():
        assert found[name] == where, (name, found[name])
    # what 0.26 lacks, restartkit stands in for (vllm_seams.no_signal_server, configure_logging, reloader)
    assert found["NoSignalServer"] is None and found["reload_weights"] is None
    assert found["configure_logging_from_args"] is None


@pytest.mark.slow
@needs_vllm
def test_every_seam_resolves_on_the_installed_cpu_build():
    assert vllm_seams.version_problem(vllm_seams.installed_version()) is None
    assert vllm_seams.missing() == []
    assert vllm_seams.resolve("NoSignalServer") is not None and vllm_seams.resolve("reload_weights") is not None


def test_a_bare_wake_answer_of_vllm_026_is_proven_by_is_sleeping():
    """vLLM 0.26 answers /wake_up with an empty 200 (0.30+: {"status": "awake"}): seen on the H200.  The adapter
    takes it, and the sleep cycle's /is_sleeping check after the wake (can_confirm_sleep) is the proof."""
    from restartkit.engines.vllm import VLLMAdapter
    ad = VLLMAdapter()
    assert ad.can_confirm_sleep
    assert ad.wake_is_complete({}) and ad.wake_is_complete({"status": "awake"})
    assert not ad.wake_is_complete({"status": "sleeping"})


def test_a_seam_whose_module_cannot_be_imported_says_why(monkeypatch):
    """Seen on the H200: a package vLLM needs was missing, and restartkit said "vLLM 0.26.0 has no
    build_async_engine_client".  A module that is there but fails to import is named with its error; a module that
    is not there at all (another layout) is passed over."""
    monkeypatch.setitem(vllm_seams.SEAMS, "probe", (("tests.fixtures.no_such_layout", "tests.fixtures.broken_import"),
                                                    True))
    vllm_seams.resolve.cache_clear()
    with pytest.raises(vllm_seams.SeamMissing) as e:
        vllm_seams.resolve("probe")
    assert "importing tests.fixtures.broken_import failed" in str(e.value)
    assert "No module named 'restartkit_no_such_package'" in str(e.value) and "no_such_layout" not in str(e.value)
    monkeypatch.setitem(vllm_seams.SEAMS, "probe", (("tests.fixtures.no_such_layout",), True))
    vllm_seams.resolve.cache_clear()
    assert vllm_seams.resolve("probe") is None  # optional, and absent: restartkit's stand-in
