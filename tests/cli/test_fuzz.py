"""Bad input, fuzzed: mutated policy files and bad command lines.

Every policy is either accepted with values that make sense downstream, or
refused with exit 2 naming the file and the key in a short message; never a
traceback.  RESTARTKIT_FUZZ_EXAMPLES=10000 runs a long campaign (default: a
few hundred, seeded)."""
import json
import math
import os
import re

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from restartkit.errors import PolicyError
from restartkit.policy import SCHEMA, load_policy
from tests.helpers import run_cli

EXAMPLES = int(os.environ.get("RESTARTKIT_FUZZ_EXAMPLES", "300"))

BASE = {
    "service": {"name": "svc", "engine": "reference", "model": "/models/tiny", "port": 8000},
    "restart": {"start_timeout_s": 60.0},
    "ipc": {}, "criu": {}, "sleep": {},
}


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def toml_text(data: dict) -> str:
    out = []
    for sec, keys in data.items():
        out.append(f"[{sec}]")
        out += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in keys.items()]
        out.append("")
    return "\n".join(out)


scalars = st.one_of(
    st.booleans(), st.integers(min_value=-2**63, max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 65535, 65536, 70000, 1e308, 1e-300, 0.001, "", ".", "..", "-x", "a" * 300,
                     "daily\nUnit=reboot.target", "$(reboot)", "host\nname", "svc\n", "x" * 100_000,
                     "/tmp/dir\nwith newline", "auto", "cold", "zero_copy", "cpu", "cuda"]),
    st.text(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)
ALL_KEYS = [(sec, k) for sec, keys in SCHEMA.items() for k in keys]


@st.composite
def mutated_policies(draw):
    data = json.loads(json.dumps(BASE))
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        sec, key = draw(st.sampled_from(ALL_KEYS + [("service", "bogus"), ("nope", "x")]))
        data.setdefault(sec, {})[key] = draw(values)
    return data


SPECIAL = st.sampled_from(["", ".", "..", "-x", "a" * 300, "daily\nUnit=reboot.target", "$(reboot)", "x\ny", "svc\n",
                           "/tmp/a\tb", "inf", "127.0.0.1", "0.0.0.0", "::1", "host-name.example", "*-*-* 03:00:00"])
STRING_KEYS = [(sec, k) for sec, keys in SCHEMA.items() for k, spec in keys.items() if spec.type is str]
NUMBER_KEYS = [(sec, k) for sec, keys in SCHEMA.items() for k, spec in keys.items() if spec.type in (int, (int, float))]


@seed(20261130)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(STRING_KEYS + NUMBER_KEYS), value=st.one_of(
    SPECIAL, st.text(max_size=30), st.floats(), st.integers(min_value=-2**63, max_value=2**63 - 1)))
def test_one_key_at_a_time(tmp_path, key, value):
    """The property below with exactly one key changed: each key's own check is what decides."""
    data = json.loads(json.dumps(BASE))
    data.setdefault(key[0], {})[key[1]] = value
    check_policy(tmp_path, data)


@seed(20261130)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated_policies())
def test_a_mutated_policy_is_accepted_sanely_or_refused_with_its_key(tmp_path, data):
    check_policy(tmp_path, data)


def check_policy(tmp_path, data):
    path = tmp_path / "p.toml"
    path.write_text(toml_text(data))
    try:
        pol = load_policy(path)
    except PolicyError as e:
        msg = str(e)
        each = getattr(e, "errors", [e])  # every problem of the file at once: each one bounded
        assert str(path) in msg and all(len(str(x)) < 600 for x in each), msg
        for x in each:
            if x.key:
                assert re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", x.key), x.key
        return
    s = pol.service
    assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", s["name"]) and s["name"] not in (".", "..")
    assert pol.state_dir().parent != pol.state_dir() and pol.state_dir().name == s["name"]
    for sec, keys in SCHEMA.items():
        for k, v in pol.sections[sec].items():
            if isinstance(v, float):
                assert math.isfinite(v), (sec, k, v)
            if isinstance(v, str):
                assert "\n" not in v and "\0" not in v, (sec, k, v)
    assert pol.restart["canary_prompts"] and all(isinstance(p, str) and p for p in pol.restart["canary_prompts"])
    assert all(isinstance(v, str) for v in s["env"].values())
    assert all(isinstance(a, str) for a in s["command"] + s["engine_args"])
    assert 0 <= pol.ipc["health_port"] < 65536


def test_deep_nesting_is_refused_without_a_traceback(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text('[service]\nname = "svc"\nmodel = "/m"\nengine_args = ' + "[" * 5000 + "]" * 5000 + "\n")
    for args in (("policy", "check", path), ("plan", "--policy", path, "--json")):
        r = run_cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr and str(path) in r.stderr, r.stderr


@pytest.mark.parametrize("line,key", [
    ('name = "' + "a" * 300 + '"', "service.name"), ('name = ".."', "service.name"), ('name = "-rf"', "service.name"),
    ('name = "svc\\n"', "service.name"), ('host = "127.0.0.1\\n$(reboot)"', "service.host"),
    ('env = {X = 1}', "service.env"), ('command = [1, 2]', "service.command"),
    ('state_dir = "/tmp/a\\nb"', "service.state_dir"),
    ('state_dir = "/tmp/' + "s" * 300 + '"', "service.state_dir"), ('draft_model = "/' + "m" * 256 + '"', "service.draft_model"),
    ('tensor_parallel_size = 1000000', "service.tensor_parallel_size"),
    ('data_parallel_size = 100000', "service.data_parallel_size"),
])
def test_service_values_that_break_things_later_are_refused(tmp_path, line, key):
    path = tmp_path / "p.toml"
    path.write_text(f'[service]\nmodel = "/m"\n{line}\n' + ('name = "svc"\n' if "name" not in line else ""))
    r = run_cli("policy", "check", path)
    assert r.returncode == 2 and f"[{key}]" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr) < 600, r.stderr


@pytest.mark.parametrize("section,line,key", [
    ("restart", "start_timeout_s = inf", "restart.start_timeout_s"),
    ("restart", "stop_timeout_s = 1e308", "restart.stop_timeout_s"),
    ("criu", "pid_wait_s = 1e-300", "criu.pid_wait_s"),
    ("restart", "canary_prompts = []", "restart.canary_prompts"),
    ("restart", "canary_prompts = [true]", "restart.canary_prompts"),
    ("ipc", "health_port = 70000", "ipc.health_port"), ("ipc", "health_port = -1", "ipc.health_port"),
    ("criu", 'refresh = "daily\\nUnit=reboot.target"', "criu.refresh"),
    ("sleep", "min_freed_fraction = 5.0", "sleep.min_freed_fraction"),
])
def test_meaningless_values_are_refused_with_what_is_allowed(tmp_path, section, line, key):
    path = tmp_path / "p.toml"
    path.write_text(f'[service]\nname = "svc"\nmodel = "/m"\n[{section}]\n{line}\n')
    r = run_cli("policy", "check", path)
    assert r.returncode == 2 and f"[{key}]" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_long_value_is_cut_in_the_message(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[service]\nname = "svc"\nmodel = "/m"\nhost = "' + "x" * 100_000 + '"\n')
    r = run_cli("policy", "check", path)
    assert r.returncode == 2 and len(r.stderr) < 600 and "100002 characters" in r.stderr, r.stderr[:800]


def test_calendar_expressions_that_systemd_knows_pass(tmp_path):
    for expr in ("daily", "hourly", "*-*-* 03:00:00", "Mon..Fri 04:30", "weekly"):
        path = tmp_path / "p.toml"
        path.write_text(f'[service]\nname = "svc"\nmodel = "/m"\n[criu]\nrefresh = "{expr}"\n')
        r = run_cli("policy", "check", path, "--skip-host")  # /m: the file only
        assert r.returncode == 0, (expr, r.stderr)


# ---- command lines --------------------------------------------------------------------------------

BAD_COMMAND_LINES = [
    ("bench", "--policy", "{policy}", "--strategies", "bogus"),
    ("bench", "--policy", "{policy}", "--repeat", "0"),
    ("preload", "--policy", "{policy}", "--tensor-parallel-size", "0"),
    ("preload", "--policy", "{policy}", "--tensor-parallel-size", "-2"),
    ("preload", "--policy", "{policy}", "--nnodes", "0"),
    ("model", "create", "--out", "/etc/passwd/dir/model"),  # a file where a parent directory should be
    ("model", "create", "--out", "{tmp}/m", "--device", "tpu"),
    ("engine", "serve", "--model", "{tmp}", "--port", "70000"),
    ("snapshot", "refresh", "--policy", "{policy}", "--install-timer", "--unit-dir", "/nonexistent/units"),
    ("history", "--policy", "{policy}", "--last", "-5"),
    ("snapshot", "prune", "--policy", "{policy}", "--keep", "-1"),
    ("snapshot", "prune", "--policy", "{policy}", "--keep", "0"),
    ("restart", "--policy", "{policy}", "--strategy", "bogus"),
    ("restart", "--policy", "{policy}", "--wait", "-1"),
    ("restart", "--policy", "{policy}", "--wait", "nan"),
    ("restart", "--policy", "{policy}", "--wait", "inf"),
    ("stop", "--policy", "{policy}", "--wait", "1e12"),
    ("preload", "--policy", "{policy}", "--startup-timeout", "nan"),
    ("preload", "--policy", "{policy}", "--startup-timeout", "-inf"),
    ("sleep", "--policy", "{policy}", "--level", "3"),
    ("plan", "--policy", "/nonexistent.toml"),
    ("plan", "--policy", "/tmp/" + "p" * 300 + ".toml"),
]


@pytest.mark.parametrize("args", BAD_COMMAND_LINES, ids=lambda a: " ".join(a[:3]))
def test_bad_command_lines_are_usage_errors_before_anything_starts(make_policy, tmp_path, args):
    policy = make_policy()
    argv = [a.format(policy=policy, tmp=tmp_path) for a in args]
    r = run_cli(*argv, timeout=120)
    assert r.returncode == 2, (argv, r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.strip(), r.stderr
    assert not (tmp_path / "state" / "svc" / "engine.json").exists()  # nothing was started


# ---- history records and snapshot manifests ------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**63), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=5)),
    max_leaves=20)
RECORD_KEYS = ["id", "service", "requested", "reason", "started_at", "finished_at", "attempts", "final_state",
               "served_by", "via_recovery", "recovery_reason", "time_to_ready_s", "first_completion_s", "downtime",
               "context", "trigger", "proof", "plan"]
records = st.one_of(json_values, st.fixed_dictionaries({}, optional={k: json_values for k in RECORD_KEYS}),
                    st.fixed_dictionaries({"started_at": st.floats(), "final_state": st.sampled_from(["serving", 1]),
                                           "attempts": st.lists(st.one_of(json_values, st.fixed_dictionaries(
                                               {"strategy": st.sampled_from(["cold", "criu", 3])},
                                               optional={"proof": json_values, "skipped": json_values,
                                                         "role": json_values, "ok": json_values,
                                                         "phases": json_values})), max_size=3)},
                                          optional={"context": json_values, "time_to_ready_s": json_values,
                                                    "downtime": json_values, "via_recovery": json_values,
                                                    "served_by": json_values}))


@seed(26)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(rec=records)
def test_a_record_of_any_shape_is_used_or_skipped_never_raised(rec):
    """What reads history.jsonl (evidence, history, status) gets only records of the shape it reads."""
    from restartkit.evidence import summarize
    from restartkit.policy import parse_policy
    from restartkit.record import record_problem, render_record
    problem = record_problem(rec)
    assert problem is None or isinstance(problem, str)
    assert isinstance(render_record(rec if isinstance(rec, dict) else {"id": rec}), str)
    if problem is None:
        policy = parse_policy({"service": {"name": "s", "model": "/m"}})
        summarize([rec], rec.get("context") or {}, policy, ["sleep", "criu", "cold"], now=2e9)


MANIFEST_KEYS = ["created_at", "pid", "tree_pids", "identity", "canary", "kind", "files", "suspect", "phases",
                 "image_bytes", "weight_cache", "tested", "gpu", "service"]
manifests = st.one_of(json_values, st.fixed_dictionaries({}, optional={k: json_values for k in MANIFEST_KEYS}),
                      st.fixed_dictionaries({"created_at": st.floats(), "pid": st.integers(), "tree_pids":
                                             st.lists(st.integers(), max_size=3), "identity": json_values,
                                             "canary": json_values},
                                            optional={k: json_values for k in MANIFEST_KEYS[5:]}))


@seed(27)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(m=manifests)
def test_a_manifest_of_any_shape_is_usable_or_named_damaged(tmp_path_factory, m):
    from restartkit.snapshot.ops import mismatches
    from restartkit.snapshot.store import MANIFEST, SnapshotStore
    root = tmp_path_factory.mktemp("snaps")
    os.chmod(root, 0o700)
    (root / "s1").mkdir()
    (root / "s1" / MANIFEST).write_text(json.dumps(m))
    snap = SnapshotStore(root).get("s1")
    assert snap is not None
    if snap.damaged is None:
        assert isinstance(mismatches(snap.manifest["identity"], {"arch": "x86_64"}), list)
        assert isinstance(snap.age_s, float)
    else:
        assert isinstance(snap.damaged, str)
