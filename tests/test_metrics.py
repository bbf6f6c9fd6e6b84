"""The Prometheus textfiles as a fleet reads them: `promtool check metrics` on every one restartkit
writes, and [metrics] textfile_dir read by a real prometheus-node-exporter running as another user
(nobody), scraped over loopback: no scrape error, every family there."""
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import free_port, prom_sample, promtool_check, run_cli, tool

@pytest.fixture
def textfile_dir():
    """A directory another user can reach (pytest's tmp_path is 0700), not yet made: restartkit makes it."""
    parent = Path(tempfile.mkdtemp(prefix="rk-textfiles-"))
    parent.chmod(0o755)
    yield parent / "textfiles"
    shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.slow
def test_every_textfile_passes_promtool_and_a_node_exporter_of_another_user_reads_them(
        make_policy, service_cleanup, textfile_dir):
    policy = make_policy(extra=f'\n[metrics]\ntextfile_dir = "{textfile_dir}"\n')
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    for _ in range(2):
        r = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")
        assert r.returncode == 0, r.stderr
    assert run_cli("snapshot", "prune", "--policy", policy).returncode == 0  # writes the snapshot textfile
    restarts, snapshot = textfile_dir / "restartkit_svc.prom", textfile_dir / "restartkit_svc_snapshot.prom"
    assert sorted(p.name for p in textfile_dir.iterdir()) == [restarts.name, snapshot.name]  # no temporary left
    assert (textfile_dir.stat().st_mode & 0o777) == 0o755
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in (restarts, snapshot))
    assert not (policy.parent / "state" / "svc" / "metrics.prom").exists()  # one place, the one asked for
    for p in (restarts, snapshot):
        promtool_check(p)
    text = restarts.read_text()
    from restartkit import __version__
    assert prom_sample(text, "restartkit_build_info", service="svc", version=__version__) == 1
    assert prom_sample(text, "restartkit_time_to_ready_seconds_count", service="svc", strategy="cold") == 2
    assert prom_sample(text, "restartkit_time_to_ready_seconds_bucket", service="svc", strategy="cold", le="+Inf") == 2
    assert time.time() - prom_sample(text, "restartkit_last_restart_timestamp_seconds", service="svc") < 600
    assert prom_sample(text, "restartkit_supervise_give_ups_total", service="svc") == 0
    assert prom_sample(snapshot.read_text(), "restartkit_snapshot_current_bytes", service="svc") == 0

    exporter = tool("prometheus-node-exporter")
    if exporter is None or os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs prometheus-node-exporter, root and setpriv to run the exporter as nobody")
    port = free_port()
    node = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", exporter,
                             "--collector.disable-defaults", "--collector.textfile",
                             f"--collector.textfile.directory={textfile_dir}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        body = None
        for _ in range(100):
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                assert node.poll() is None, node.stdout.read()
                time.sleep(0.1)
        assert body is not None, "the node exporter never answered"
    finally:
        node.terminate()
        node.wait(10)
    assert prom_sample(body, "node_textfile_scrape_error") == 0, body[-2000:]
    assert prom_sample(body, "restartkit_restart_total", service="svc", strategy="cold", outcome="ok") == 2
    assert prom_sample(body, "restartkit_snapshot_suspect", service="svc") == 0


def test_the_default_textfiles_in_the_state_dir_pass_promtool(tmp_path):
    from restartkit.record import Record, count_give_up, update_metrics
    rec = Record(service="svc", policy="p.toml", requested="ipc", reason="crash", plan={})
    rec.attempts = [{"strategy": "ipc", "ok": False}, {"strategy": "cold", "ok": True, "role": "recovery"}]
    rec.final_state, rec.served_by, rec.time_to_ready_s, rec.via_recovery = "serving", "cold", 7.5, True
    rec.downtime = {"downtime_s": 8.0}
    update_metrics(tmp_path, rec.finish(False))
    prom = count_give_up(tmp_path, "svc")
    promtool_check(prom)
    text = prom.read_text()
    assert prom_sample(text, "restartkit_supervise_give_ups_total", service="svc") == 1
    assert prom_sample(text, "restartkit_time_to_ready_seconds_bucket", service="svc", strategy="cold", le="5.0") == 0
    assert prom_sample(text, "restartkit_time_to_ready_seconds_bucket", service="svc", strategy="cold", le="10.0") == 1
    assert json.loads((tmp_path / "metrics.json").read_text())["give_ups"] == 1
