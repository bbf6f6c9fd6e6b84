"""The house's rules, checked over the source (ast), not by reading: data flows one way
(policy -> facts -> plan -> execute -> record), nothing imports the CLI, strategies are
looked up through the registry only by the restart flow, no import circle between files,
the floors (process/, guard/) import nothing above them, the core names no other module,
functions fit on a screen, no test file imports another, and state never travels through
the process's own environment."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = "restartkit.cli"
STRATEGIES = "restartkit.strategies"
REGISTRY_USERS = {"restartkit.restart"}  # the restart flow gathers, plans and executes through the registry


def _modules() -> dict[str, Path]:
    mods = {}
    for p in sorted([*ROOT.glob("restartkit/**/*.py"), *ROOT.glob("strategies/*.py")]):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "strategies":  # packaged as restartkit.strategies
            parts = ["restartkit", *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _runtime_imports(node: ast.AST):
    """Every import, at module level or inside a function, except those under `if TYPE_CHECKING:`."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
            for stmt in child.orelse:
                yield from _runtime_imports(stmt)
        else:
            yield from _runtime_imports(child)


def graph() -> dict[str, set[str]]:
    mods = _modules()
    out = {}
    for name, path in mods.items():
        deps = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("restartkit"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("restartkit"))
        out[name] = {d for d in deps if d in mods and d != name}
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package():
    g = graph()
    assert {"restartkit.cli", "restartkit.restart", "restartkit.strategies.criu", "restartkit.contracts"} <= set(g)
    assert "restartkit.planner" in g["restartkit.restart"]  # lazy and top-level imports both count


def test_nothing_but_the_entry_point_imports_the_cli():
    """The cli package's modules import one another; nothing outside it imports any of them, and `python -m
    restartkit.cli` (its __main__) is the entry point."""
    def cli(m: str) -> bool:
        return m == CLI or m.startswith(CLI + ".")
    assert [m for m, deps in graph().items() if not cli(m) and any(cli(d) for d in deps)] == []


def test_cli_modules_are_thin():
    """One module per command group, each short: what a command does lives in the library."""
    long = {p.name: n for p in (ROOT / "restartkit" / "cli").glob("*.py") if (n := len(p.read_text().splitlines())) > 200}
    assert long == {}, long


def test_only_the_restart_flow_imports_strategies():
    g = graph()
    outside = {m: sorted(d for d in deps if d.startswith(STRATEGIES)) for m, deps in g.items()
               if not m.startswith(STRATEGIES) and any(d.startswith(STRATEGIES) for d in deps)}
    assert set(outside) <= REGISTRY_USERS, outside
    assert all(ds == [STRATEGIES] for ds in outside.values()), outside  # the registry, never a strategy's module


def test_the_core_imports_nothing_that_uses_it():
    assert graph()["restartkit.contracts"] == set()


def test_no_import_circle():
    assert cycles(graph()) == []


def test_a_circle_is_found_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_state_through_the_environment():
    """os.environ is written only where a child's environment is built (a dict of its own)."""
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            target = None
            if isinstance(node, ast.Assign):
                target = node.targets[0]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("setdefault", "update", "pop", "__setitem__"):
                target = node.func.value
            if isinstance(target, ast.Subscript):
                target = target.value
            if target is not None and ast.unparse(target) == "os.environ":
                offenders.append(f"{name}:{node.lineno}")
    assert offenders == []


def test_the_cli_offers_every_model_preset():
    from restartkit.cli import MODEL_PRESETS
    from restartkit.reference.model.checkpoint import PRESETS
    assert MODEL_PRESETS == list(PRESETS)


def test_the_floors_import_nothing_above_them():
    """process/ (one engine process) and guard/ (lock, preflight, intent) are what the rest stands
    on: they import no command and no strategy; guard imports only process/ and the small helpers."""
    g = graph()
    above = ("restartkit.commands", STRATEGIES)
    for floor in ("restartkit.process", "restartkit.guard"):
        bad = {m: sorted(d for d in deps if d.startswith(above)) for m, deps in g.items()
               if m.startswith(floor) and any(d.startswith(above) for d in deps)}
        assert bad == {}, bad
    helpers = ("restartkit.process", "restartkit.guard", "restartkit.errors", "restartkit.files")
    bad = {m: sorted(d for d in deps if not d.startswith(helpers)) for m, deps in g.items()
           if m.startswith("restartkit.guard") and any(not d.startswith(helpers) for d in deps)}
    assert bad == {}, bad


def test_the_core_names_no_other_module_even_for_type_checking():
    tree = ast.parse((ROOT / "restartkit" / "contracts.py").read_text())
    named = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             and "restartkit" in ast.unparse(n)]
    assert named == []


def test_the_top_level_holds_the_restart_flow_only():
    """The restart flow and the small helpers at the top; everything else in a folder by role."""
    flat = sorted(p.name for p in (ROOT / "restartkit").glob("*.py"))
    assert len(flat) <= 16, flat


FUNCTION_MAX = 80  # lines; over LONG, a comment starting "# long:" says why
LONG = 60


def test_functions_fit_on_a_screen():
    too_long, unexplained = [], []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = node.end_lineno - node.lineno + 1
            body = lines[node.lineno - 1:node.end_lineno]
            if n > FUNCTION_MAX:
                too_long.append(f"{name}.{node.name}: {n} lines")
            elif n > LONG and not any(line.strip().startswith("# long:") for line in body):
                unexplained.append(f"{name}.{node.name}: {n} lines")
    assert too_long == [] and unexplained == [], (too_long, unexplained)


def test_no_test_file_imports_another():
    """Shared fixtures live in conftest.py, shared steps in tests/helpers.py."""
    offenders = []
    tests = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").rsplit(".", 1)[-1] in tests:
                offenders.append(f"{path.name} imports {node.module}")
    assert offenders == []


def test_tests_are_grouped_by_the_package_they_test():
    """tests/<room>/ for each room of the package; at the top only what spans the rooms (the house's rules, the
    planner and the restart flow, records and metrics, deployment)."""
    rooms = {p.name for p in (ROOT / "restartkit").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    groups = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert groups <= rooms | {"engines"}, groups - rooms
    assert len(list((ROOT / "tests").glob("test_*.py"))) <= 25


def test_one_registry_of_strategies_per_command():
    from restartkit.strategies import all_strategies, get_strategy
    from restartkit.errors import UsageError
    assert all_strategies() is all_strategies()  # built once; strategies hold no state
    import pytest
    with pytest.raises(UsageError, match="not supported.*sleep, standby, criu\\+ipc, ipc, criu, cold"):
        get_strategy("warp")


def test_engine_adapters_come_from_one_registry():
    from restartkit.engines import ENGINE_NAMES, get_adapter
    from restartkit.policy import SCHEMA
    assert SCHEMA["service"]["engine"].allowed == ENGINE_NAMES  # the policy names no engine of its own
    assert [type(get_adapter(n)[0]).__name__ for n in ENGINE_NAMES] == [
        "ReferenceAdapter", "VLLMAdapter", "SGLangAdapter", "CommandAdapter"]
    adapter, why = get_adapter("tgi")
    assert adapter is None and "not supported (choices: reference, vllm, sglang, command)" in why


def test_every_package_is_in_the_wheel():
    """pyproject lists packages one by one: a folder left out installs only in editable mode."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "restartkit").rglob("__init__.py")}
    found |= {"restartkit.strategies"} if (ROOT / "strategies" / "__init__.py").exists() else set()
    assert found - listed == set(), found - listed


def test_the_reference_engine_is_in_folders_by_role():
    """The serving surface, the scheduler, the runtime and the model; nothing big left at the top, the model
    never importing the serving surface or the scheduler."""
    ref = ROOT / "restartkit" / "reference"
    assert all(len(p.read_text().splitlines()) <= 500 for p in ref.glob("*.py"))
    assert {p.name for p in ref.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "serving", "sched", "runtime", "model"}
    for path in (ref / "model").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.startswith(("restartkit.reference.serving", "restartkit.reference.sched"))
                               for n in names), f"{path.name} imports {names}"


def test_the_reference_engine_has_one_owner_per_step():
    """surface -> scheduler -> runner -> model: runtime/ imports nothing of the reference engine but model/ (and
    itself), sched/ nothing of serving/; the surface submits and does admin work through the scheduler it holds,
    never through the runner's."""
    ref = ROOT / "restartkit" / "reference"
    allowed = {"runtime": ("restartkit.reference.model", "restartkit.reference.runtime"),
               "sched": ("restartkit.reference.model", "restartkit.reference.runtime", "restartkit.reference.sched")}
    for room, ok in allowed.items():
        for path in (ref / room).glob("*.py"):
            for node in _runtime_imports(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                inside = [n for n in names if n.startswith("restartkit.reference")]
                assert all(n.startswith(ok) for n in inside), f"{room}/{path.name} imports {inside}"
    steps = {"submit", "exclusive", "release_weights", "reattach_weights", "drop_kv_cache", "restore_kv_cache"}
    for path in (ref / "serving").glob("*.py"):
        tree = ast.parse(path.read_text())
        targets = {id(t) for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in steps:
                owner = node.func.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                assert name == "scheduler", f"{path.name}:{node.lineno} {name}.{node.func.attr}() (not the scheduler)"
            if isinstance(node, ast.Attribute) and node.attr == "scheduler" and id(node) not in targets:
                assert getattr(node.value, "id", "") in ("st", "state", "self") or getattr(
                    node.value, "attr", "") == "state", f"{path.name}:{node.lineno} reaches the engine's scheduler"


def test_the_front_imports_no_torch_and_nothing_of_the_engines():
    """The front restarts in milliseconds: it imports the standard library, aiohttp (uvloop where installed) and
    itself only."""
    import sys
    for path in (ROOT / "restartkit" / "front").glob("*.py"):
        for node in _runtime_imports(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for n in names:
                top = n.split(".")[0]
                assert top in sys.stdlib_module_names or top in ("aiohttp", "uvloop", "__future__") or n.startswith(
                    "restartkit.front"), f"front/{path.name} imports {n}"


def test_the_supervisor_does_one_job():
    """supervise's loop only: the held socket, the standby keeper, the start limit, the probes and its state file
    are classes of their own (restartkit/supervision/)."""
    tree = ast.parse((ROOT / "restartkit" / "commands" / "supervise.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Supervisor"]
    assert cls.end_lineno - cls.lineno + 1 <= 250
    long = {f.name: f.end_lineno - f.lineno + 1 for f in cls.body
            if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > 30}
    assert long == {}, long


def test_nothing_below_the_commands_imports_them():
    """commands/ holds commands and their bodies: only the CLI and other commands import them."""
    bad = {m: sorted(d for d in deps if d.startswith("restartkit.commands")) for m, deps in graph().items()
           if not m.startswith(("restartkit.commands", CLI)) and any(d.startswith("restartkit.commands") for d in deps)}
    assert bad == {}, bad


def test_the_bench_scripts_share_benchlib_and_import_no_sibling():
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    bad = {}
    for p in (ROOT / "scripts").glob("*.py"):
        for node in _runtime_imports(ast.parse(p.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            bad.update({p.name: n for n in names if n in scripts and n != "benchlib"})
    assert bad == {}, bad


def test_no_module_is_over_500_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}, long
