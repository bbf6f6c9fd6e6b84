"""Policy files: defaults, and errors that name the file, the key and what is allowed."""
import pytest

from restartkit.commands.demo import DEFAULT_PORT, DEFAULT_WORKDIR, DEMO_POLICY
from restartkit.errors import PolicyError
from restartkit.policy import load_policy, parse_policy
from tests.helpers import ROOT

BASE = {"service": {"name": "s", "model": "/m"}}


def with_(section, **kv):
    data = {k: dict(v) for k, v in BASE.items()}
    data.setdefault(section, {}).update(kv)
    return data


def test_defaults_are_filled():
    p = parse_policy(BASE)
    assert p.service["port"] == 8000
    assert p.ipc["connect_timeout_s"] == 5.0 and p.ipc["state_timeout_s"] == 300.0 and p.ipc["fallback"] is True
    assert p.strategies == ["auto"]


@pytest.mark.parametrize("data, key, words", [
    (with_("service", port=70000), "service.port", "1..65535"),
    (with_("service", port=True), "service.port", "integer"),
    (with_("ipc", fallback="false"), "ipc.fallback", "boolean"),
    (with_("ipc", mode="fast"), "ipc.mode", "zero_copy, copy"),
    (with_("service", revision="main"), "service.revision", "40-character"),
    (with_("restart", strategies=["cold", "warp"]), "restart.strategies", "warp"),
    (with_("sleep", level=3), "sleep.level", "1, 2"),
    (with_("service", colour="red"), "service.colour", "keys of [service]"),
    ({"service": {"name": "s"}}, "service.model", "required"),
    ({**BASE, "extra": {}}, "extra", "sections are"),
    (with_("ipc", draft_model="/d"), "ipc.draft_model", "[service] draft_model"),
    (with_("service", draft_model="/d", engine="vllm"), "service.draft_model", "engine_args"),
    (with_("service", draft_model="/d", num_speculative_tokens=0), "service.num_speculative_tokens", "greater than 0"),
    (with_("restart", canary_max_tokens=2000), "restart.canary_max_tokens", "does not fit in [service] max_model_len"),
])
def test_bad_values_name_the_key_and_the_fix(data, key, words):
    with pytest.raises(PolicyError) as e:
        parse_policy(data, "svc.toml")
    assert e.value.key == key
    assert "svc.toml" in str(e.value) and words in str(e.value)


def test_a_string_false_is_not_a_boolean():
    # the prior art treats fallback = "false" as true; we refuse it
    with pytest.raises(PolicyError, match="fallback"):
        parse_policy(with_("ipc", fallback="false"))


def test_bad_toml_names_the_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[service\nname = 1")
    with pytest.raises(PolicyError, match="bad.toml.*not valid TOML"):
        load_policy(f)


def test_missing_file(tmp_path):
    with pytest.raises(PolicyError, match="no such policy file"):
        load_policy(tmp_path / "nope.toml")


def test_example_policies_parse():
    for f in (ROOT / "policies").glob("*.toml"):
        load_policy(f)


def test_demo_policy_file_matches_the_embedded_template():
    assert (ROOT / "policies" / "demo.toml").read_text() == DEMO_POLICY.format(workdir=DEFAULT_WORKDIR, port=DEFAULT_PORT)


FILE = '[service]\nname = "svc"\nengine = "{engine}"\nmodel = "{model}"\nport = 8000\n{service}'
COMBINATIONS = [
    ('[sleep]\nenabled = true\n[ipc]\n', "reference", "",
     ['ipc is never eligible', 'set [ipc] mode = "copy", or [sleep] enabled = false']),
    ('[standby]\nenabled = true\n[ipc]\nmode = "copy"\n', "reference", "",
     ['standby is never eligible', '[ipc] mode is \'copy\'', 'set [ipc] mode = "zero_copy"']),
    ('[standby]\nenabled = true\n[sleep]\nenabled = true\n', "reference", "",
     ['sleep is not eligible once a standby serves']),
    ('[sleep]\nenabled = true\n', "command", 'command = ["true"]\n',
     ['sleep is never eligible', 'generic command engine has no sleep interface']),
    ('[criu]\n', "reference", "tensor_parallel_size = 2\n",
     ['criu is never eligible', 'tensor_parallel_size = 2', 'remove [criu]']),
    ('[restart]\noverlap = true\n', "vllm", "", ['[restart] overlap = true does nothing', 'set it to false']),
]


@pytest.mark.parametrize("extra,engine,service,words", COMBINATIONS)
def test_policy_check_warns_about_a_strategy_the_policy_rules_out(tmp_path, tiny_model, extra, engine, service, words):
    import json
    from tests.helpers import run_cli
    p = tmp_path / "p.toml"
    p.write_text(FILE.format(engine=engine, service=service, model=tiny_model) + extra)
    r = run_cli("policy", "check", str(p), "--json")
    errors = json.loads(r.stdout)["errors"]  # vLLM may not be installed where this runs: nothing else
    assert all("is not installed" in e["error"] for e in errors), errors
    assert r.returncode == (2 if errors else 0), r.stderr
    found = json.loads(r.stdout)["warnings"]
    assert len(found) == 1 and all(w in found[0] for w in words), found
    assert f"warning: {found[0]}" in r.stderr


def test_a_policy_without_conflicts_has_no_warnings(tmp_path):
    from restartkit.policy.warnings import warnings
    p = tmp_path / "p.toml"
    p.write_text(FILE.format(engine="reference", service="", model="/m") + '[sleep]\nenabled = true\n[ipc]\nmode = "copy"\n[criu]\n')
    assert warnings(load_policy(p)) == []
    p.write_text(FILE.format(engine="reference", service="", model="/m") + '[standby]\nenabled = true\n[ipc]\n')
    assert warnings(load_policy(p)) == []


@pytest.mark.slow
def test_preload_warns_too(make_policy, sockdir):
    from tests.helpers import run_cli
    from tests.helpers import ipc_policy
    policy = ipc_policy(make_policy, sockdir)
    policy.write_text(policy.read_text() + "\n[sleep]\nenabled = true\n")
    try:
        r = run_cli("preload", "--policy", policy, "--detach")
        assert r.returncode == 0, r.stdout + r.stderr
        assert 'warning: ipc is never eligible with this policy' in r.stdout and '[ipc] mode = "copy"' in r.stdout
    finally:
        run_cli("weightcache", "release", "--policy", policy, "--stop", "--force")


@pytest.mark.parametrize("engine,model,device,words", [
    ("reference", "{tmp}/absent", "cpu", ["model directory {tmp}/absent does not exist", "fix [service] model"]),
    ("reference", "{tmp}/empty", "cpu", ["{tmp}/empty has no config.json", "fix [service] model"]),
    ("reference", "{tiny}", "cuda", ['device = "cuda", and this host shows no NVIDIA GPU', 'device = "cpu"']),
    ("vllm", "{tmp}/absent", "cpu", ["does not exist (a path, not a hub id)", "fix [service] model"]),
])
def test_policy_check_refuses_what_start_would_refuse(tmp_path, tiny_model, make_policy, engine, model, device, words):
    """policy check and start run the same host checks: each problem named with its fix, exit 2 for both.
    (No GPU on the machines that run this: a CUDA policy does not fit them.)"""
    import json
    from restartkit.process.lifecycle import gpu_visible
    from tests.helpers import run_cli
    if device == "cuda" and gpu_visible():
        pytest.skip("this host has a GPU")
    (tmp_path / "empty").mkdir()
    model = model.format(tmp=tmp_path, tiny=tiny_model)
    words = [w.format(tmp=tmp_path) for w in words]
    p = tmp_path / "p.toml"
    p.write_text(FILE.format(engine=engine, service=f'device = "{device}"\n', model=model))
    r = run_cli("policy", "check", str(p), "--json")
    errors = [e for e in json.loads(r.stdout)["errors"] if "is not installed" not in e["error"]]
    assert r.returncode == 2 and errors, r.stdout + r.stderr
    if engine == "vllm" and len(errors) < len(json.loads(r.stdout)["errors"]):
        return  # vLLM not installed here: start refuses on that first
    said = errors[0]["error"] + " -> " + errors[0]["fix"]
    assert all(w in said for w in words), said
    if engine == "reference":  # start refuses the same, before it spawns anything
        policy = make_policy(service_extra=f'device = "{device}"\n')
        policy.write_text(policy.read_text().replace(str(policy.read_text().split('model = "')[1].split('"')[0]),
                                                     model))
        s = run_cli("start", "--policy", policy)
        fix = errors[0]["fix"].replace(str(p), str(policy))
        assert s.returncode != 0 and errors[0]["error"] in s.stderr and fix in s.stderr, s.stderr


def test_an_untrusted_textfile_dir_is_refused_and_a_planted_link_never_followed(tmp_path, tiny_model):
    """[metrics] textfile_dir: a symlink, or a world-writable dir without the sticky bit, is refused by policy
    check (and start) naming the key; one owned by another user is used, and a link planted at the output
    name is replaced, never written through."""
    import json
    import os
    from restartkit.record import write_textfile
    from tests.helpers import run_cli
    real, link, open_dir, sticky = (tmp_path / n for n in ("real", "link", "open", "sticky"))
    for d in (real, open_dir, sticky):
        d.mkdir()
    link.symlink_to(real)
    open_dir.chmod(0o777)
    sticky.chmod(0o1777)
    os.chown(real, 65534, 65534)  # another user's, as Debian's node-exporter dir
    p = tmp_path / "p.toml"
    for d, words in ((link, "is a symlink"), (open_dir, "writable by every user and has no sticky bit"),
                     (sticky, None), (real, None)):
        p.write_text(FILE.format(engine="reference", service="", model=tiny_model)
                     + f'[metrics]\ntextfile_dir = "{d}"\n')
        r = run_cli("policy", "check", str(p), "--json")
        errors = json.loads(r.stdout)["errors"]
        if words is None:
            assert r.returncode == 0 and not errors, r.stderr
        else:
            assert r.returncode == 2 and words in errors[0]["error"] and "[metrics] textfile_dir" in errors[0]["fix"]
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (real / "restartkit_svc.prom").symlink_to(victim)
    write_textfile(real / "restartkit_svc.prom", [])
    assert victim.read_text() == "keep" and not (real / "restartkit_svc.prom").is_symlink()
    assert [n for n in os.listdir(real) if n.endswith(".tmp")] == []
