"""The Kubernetes manifests as a cluster takes them: `kubernetes-validate --strict` against the
version they target (and a broken copy refused, so the check can fail), the policy they carry
passing `restartkit policy check`, and the numbers that keep a pod from being SIGKILLed or flapping
derived from that policy: the engine's container holds the GPU (and the weight cache runs in it),
the grace period covers preStop and the stop timeout, the probes tolerate a restart, the state is
on a volume that outlives the pod."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from restartkit.policy import parse_policy
from tests.helpers import ROOT, run_cli

MANIFESTS = [ROOT / "docs" / "kubernetes.yaml", ROOT / "docs" / "kubernetes-criu.yaml"]
TARGET = "1.33.0"


def validator() -> str:
    exe = shutil.which("kubernetes-validate") or str(Path(sys.executable).parent / "kubernetes-validate")
    if not Path(exe).exists():
        pytest.skip("kubernetes-validate is not installed (it comes with the test extras: scripts/setup)")
    return exe


def docs(path: Path) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_manifest_passes_kubernetes_validate_strict(path):
    r = subprocess.run([validator(), "--strict", "-k", TARGET, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_validator_refuses_a_broken_manifest(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(MANIFESTS[0].read_text().replace("terminationGracePeriodSeconds:", "terminationGracePeriod:"))
    r = subprocess.run([validator(), "--strict", "-k", TARGET, str(broken)], capture_output=True, text=True)
    assert r.returncode != 0


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_pod_follows_from_its_policy(path, tmp_path):
    d = docs(path)
    policy_text = d["ConfigMap"]["data"]["policy.toml"]
    (tmp_path / "policy.toml").write_text(policy_text)
    r = run_cli("policy", "check", tmp_path / "policy.toml", "--json", "--skip-host")  # a GPU node's, not this host's
    assert r.returncode == 0, r.stderr
    import tomllib
    policy = parse_policy(tomllib.loads(policy_text))
    pod = d["StatefulSet"]["spec"]["template"]["spec"]
    (engine,) = pod["containers"]  # one container: the engine and its weight cache share its GPU
    cmd = " ".join(engine["command"])
    assert "restartkit supervise" in cmd and "restartkit preload" in cmd
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["shareProcessNamespace"] is True  # the pause process reaps what exits in the container
    pre_stop = int(engine["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + policy.restart["stop_timeout_s"] + 10
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= policy.restart["start_timeout_s"] + 60
    assert engine["readinessProbe"]["failureThreshold"] >= 2
    assert "livenessProbe" not in engine  # supervise is the liveness check
    port = engine["ports"][0]["containerPort"]
    assert port == policy.service["port"] and policy.service["host"] == "0.0.0.0"
    mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    claims = {c["metadata"]["name"] for c in d["StatefulSet"]["spec"]["volumeClaimTemplates"]}
    assert "state" in claims and policy.sections["service"]["state_dir"] == mounts["state"]
    assert not any(v["name"] == "state" for v in pod["volumes"])  # not an emptyDir: it outlives the pod
    assert policy.ipc["socket_dir"] == mounts["sockets"]


def test_the_plain_variant_meets_pod_security_restricted():
    """Services without CRIU need no root: the pod passes Pod Security `restricted` (its fields as that
    profile names them), and the image's non-root user is the one it runs as."""
    pod = docs(MANIFESTS[0])["StatefulSet"]["spec"]["template"]["spec"]
    psc, (engine,) = pod["securityContext"], pod["containers"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0 and psc["seccompProfile"]["type"] == "RuntimeDefault"
    sc = engine["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]} and "add" not in sc
    image = (ROOT / "docs" / "Containerfile").read_text()
    assert f"USER {psc['runAsUser']}\n" in image and "HEALTHCHECK" in image and "RESTARTKIT_RUNTIME_ONLY=1" in image
    for ignore in (".containerignore", ".dockerignore"):
        kept_out = (ROOT / ignore).read_text().split()
        assert {".venv", ".git", ".pytest_cache", "**/__pycache__"} <= set(kept_out), ignore


def test_the_refresh_cronjob_may_exec_into_its_pod_only():
    """The refresh runs in the engine's container through `kubectl exec`, from a CronJob whose service
    account may exec into that one pod (a Role, bound to it), on the policy's schedule in cron's words."""
    import tomllib
    from restartkit.policy.schedule import to_cron
    d = docs(MANIFESTS[1])
    job = d["CronJob"]["spec"]
    pod = job["jobTemplate"]["spec"]["template"]["spec"]
    refresh = tomllib.loads(d["ConfigMap"]["data"]["policy.toml"])["criu"]["refresh"]
    assert job["schedule"] == to_cron(refresh) and job["concurrencyPolicy"] == "Forbid"
    engine_pod = f"{d['StatefulSet']['metadata']['name']}-0"
    (c,) = pod["containers"]
    assert c["command"][:3] == ["kubectl", "exec", engine_pod] and "refresh" in c["command"]
    assert pod["serviceAccountName"] == d["ServiceAccount"]["metadata"]["name"]
    binding = d["RoleBinding"]
    assert binding["roleRef"]["name"] == d["Role"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    rules = d["Role"]["rules"]
    assert all(r["resourceNames"] == [engine_pod] for r in rules)  # that pod, no other
    assert {v for r in rules if r["resources"] == ["pods/exec"] for v in r["verbs"]} == {"create", "get"}
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_only_the_criu_variant_is_granted_what_criu_needs():
    plain = docs(MANIFESTS[0])["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    assert "add" not in plain["securityContext"]["capabilities"]
    sc = docs(MANIFESTS[1])["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["runAsUser"] == 0 and sc.get("privileged") is not True  # capabilities named, not everything
    assert {"SYS_ADMIN", "SYS_PTRACE", "CHECKPOINT_RESTORE"} <= set(sc["capabilities"]["add"])
    assert sc["seccompProfile"]["type"] == "Unconfined" and sc["appArmorProfile"]["type"] == "Unconfined"
    text = MANIFESTS[1].read_text()
    assert "close to root on the node" in text and "Not run on a cluster" in text
