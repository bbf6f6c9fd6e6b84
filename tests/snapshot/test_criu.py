"""The criu strategy for real: CRIU 4 (installed by scripts/install-criu)
dumps and restores the reference engine; every fault ends serving through a
cold start, with the reason in the record and the snapshot kept."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import CRIU, CRIU_MARKS, RESTARTKIT, ROOT, create, engines_on, run_cli, snapshots_dir

pytestmark = CRIU_MARKS



def restart(policy, *flags):
    r = run_cli("restart", "--policy", policy, "--json", *flags)
    return r.returncode, json.loads(r.stdout)


def assert_refused(policy, words):
    """criu named with --strategy and not eligible: refused before anything is touched (exit 2, the reason
    named), the engine serving as before, the snapshot kept."""
    before = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    r = run_cli("restart", "--policy", policy, "--strategy", "criu", "--strict")
    assert r.returncode == 2 and "criu cannot run now" in r.stderr and words in r.stderr, r.stdout + r.stderr
    after = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert after["serving"] and after["pid"] == before, after


def assert_recovered(code, rec, words):
    assert code == 3, rec
    assert rec["final_state"] == "serving" and rec["served_by"] == "cold" and rec["via_recovery"]
    assert words in rec["recovery_reason"], rec["recovery_reason"]
    assert rec["proof"]["canary_identical"] is True


def test_snapshot_and_restore_give_the_same_canary(served):
    policy = served()
    snap = create(policy)
    assert snap["left_running"] and snap["image_bytes"] > 0 and snap["kv_cache_freed_bytes"] > 0
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["serving"]  # still serving
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert next(s for s in plan["strategies"] if s["strategy"] == "criu")["eligible"], plan
    code, rec = restart(policy, "--strategy", "criu", "--strict")
    assert code == 0, rec
    assert rec["served_by"] == "criu" and rec["proof"]["canary_identical"] is True
    attempt = rec["attempts"][0]
    assert attempt["proof"]["restored_pid"] == snap["pid"]  # CRIU brings the process back under its PID
    assert {"wait_pids", "criu_restore", "kv_cache_restore"} <= set(attempt["phases"])
    # the restored engine's parent is the keeper CRIU ran under (it adopted the tree): its PID is
    # collected the moment it exits, for the next restore
    ppid = int(next(x for x in open(f"/proc/{snap['pid']}/status") if x.startswith("PPid:")).split()[1])
    assert b"keeper.py\0restore" in open(f"/proc/{ppid}/cmdline", "rb").read()
    # and the restored engine restarts again like any other
    code, rec = restart(policy, "--strategy", "cold")
    assert code == 0 and rec["proof"]["canary_identical"] is True


@pytest.mark.parametrize("fault", ["truncated", "missing"])
def test_a_broken_image_recovers_and_keeps_the_snapshot(served, fault):
    policy = served()
    snap = create(policy)
    images = snapshots_dir(policy) / snap["path"].rsplit("/", 1)[1]
    if fault == "truncated":
        pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
        with open(pages, "r+b") as f:
            f.truncate(pages.stat().st_size // 3)
    else:
        (images / "pstree.img").unlink()
    code, rec = restart(policy, "--strategy", "criu", "--strict")
    assert_recovered(code, rec, "damaged")
    assert ("pstree.img is missing" if fault == "missing" else "written as") in rec["recovery_reason"]
    assert rec["attempts"][0]["detail"]["snapshot_kept"] and images.exists()
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    assert listing[-1]["suspect"], listing  # marked, not deleted
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert any("suspect" in r for r in next(s for s in plan["strategies"] if s["strategy"] == "criu")["reasons"])


def test_a_pid_held_past_the_deadline_recovers(served):
    policy = served('pid_wait_s = 1.0\n')
    snap = create(policy, "--stop")  # the engine dies with the dump; its PID is free
    holder = take_pid(snap["pid"])
    try:
        code, rec = restart(policy, "--strategy", "criu", "--strict")
        assert_recovered(code, rec, "PIDs are taken")
        assert str(snap["pid"]) in rec["recovery_reason"]
        assert holder.poll() is None, "restartkit killed the process that held the snapshot's PID"
        assert snap["pid"] not in rec["attempts"][0].get("killed_before_recovery", [])
    finally:
        holder.kill()


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_another_users_process_on_a_snapshots_pid_is_named_and_left_alone(served):
    """PIDs wrap quickly on a busy host: a process of another user that took the snapshot's PID
    is named, never signalled, and the restart recovers cold."""
    policy = served('pid_wait_s = 1.0\n')
    snap = create(policy, "--stop")
    holder = take_pid(snap["pid"], [*NOBODY, "sleep", "300"])
    try:
        code, rec = restart(policy, "--strategy", "criu", "--strict")
        assert_recovered(code, rec, "PIDs are taken")
        assert str(snap["pid"]) in rec["recovery_reason"], rec["recovery_reason"]
        assert holder.poll() is None, "restartkit killed another user's process"
    finally:
        holder.kill()


def test_pids_written_into_a_manifest_are_never_killed(served):
    """A manifest's tree_pids edited to name other processes (here another user's and one of our
    own user's, both older than the restart) kills nothing: restartkit signals only what it started."""
    policy = served('pid_wait_s = 1.0\n')
    snap = create(policy)  # the engine keeps serving
    theirs = subprocess.Popen([*NOBODY, "sleep", "300"])
    mine = subprocess.Popen(["sleep", "300"])
    try:
        manifest = snapshots_dir(policy) / snap["id"] / "manifest.json"
        data = json.loads(manifest.read_text())
        data["tree_pids"] += [theirs.pid, mine.pid]
        manifest.write_text(json.dumps(data))
        code, rec = restart(policy, "--strategy", "criu", "--strict")
        assert rec["final_state"] == "serving", rec
        assert theirs.poll() is None and mine.poll() is None, "restartkit killed what a manifest named"
    finally:
        theirs.kill()
        mine.kill()


def test_identity_mismatch_is_named_and_recovers(served):
    policy = served()
    snap = create(policy)
    manifest_path = snapshots_dir(policy) / snap["path"].rsplit("/", 1)[1] / "manifest.json"
    m = json.loads(manifest_path.read_text())
    m["identity"]["kernel"] = "5.4.0-ancient"
    manifest_path.write_text(json.dumps(m))
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    reasons = next(s for s in plan["strategies"] if s["strategy"] == "criu")["reasons"]
    assert any("kernel: snapshot '5.4.0-ancient', host" in r for r in reasons), reasons
    assert_refused(policy, "kernel: snapshot '5.4.0-ancient'")
    assert manifest_path.exists()


def test_missing_criu_recovers(served, tmp_path):
    policy = served()
    create(policy)
    text = policy.read_text().replace("[criu]\n", f'[criu]\ncriu_path = "{tmp_path}/no-criu"\n')
    policy.write_text(text)
    assert_refused(policy, "not an executable file")


def test_sigterm_during_create_keeps_the_previous_snapshot(served):
    policy = served()
    first = create(policy)
    p = subprocess.Popen([sys.executable, "-m", "restartkit.cli", "snapshot", "create", "--policy", str(policy)],
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for line in p.stderr:
        if line.startswith("taking the canary"):
            p.send_signal(signal.SIGTERM)
            break
    p.wait(60)
    assert p.returncode != 0
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    current = [s for s in listing if s["current"]]
    assert [s["id"] for s in current] == [first["path"].rsplit("/", 1)[1]]
    time.sleep(0.5)
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["serving"]  # the engine is back


def take_pid(pid: int, argv=("sleep", "300")) -> subprocess.Popen:
    """Start a process under `pid` (root: steer the kernel's next PID)."""
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(list(argv))
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"could not start a process under PID {pid}")


def test_a_restored_engine_stopped_while_criu_restores_is_noticed_in_seconds(served, tmp_path):
    """Someone SIGSTOPs the restored engine while CRIU is still restoring it: CRIU waits for it
    for ever (the restart hung for restore_timeout_s, 602 s, and blamed the snapshot).  Watched
    like a start: noticed in seconds, CRIU and the tree killed, recovery, the snapshot not marked."""
    policy = served('pid_wait_s = 5.0\nrestore_timeout_s = 600\n')
    snap = create(policy, "--stop")
    pid = snap["pid"]
    w = tmp_path / "criu-and-a-stop"
    w.write_text(f'#!/bin/sh\n[ "$1" != restore ] && exec {CRIU.path} "$@"\n{CRIU.path} "$@" &\n'
                 f'while ! kill -0 {pid} 2>/dev/null; do sleep 0.001; done\nkill -STOP {pid}\nwait $!\n')
    w.chmod(0o755)
    policy.write_text(policy.read_text().replace("[criu]\n", f'[criu]\ncriu_path = "{w}"\n'))
    t0 = time.monotonic()
    code, rec = restart(policy, "--strategy", "criu", "--strict")
    assert time.monotonic() - t0 < 120, "the restart waited for the stopped tree"
    assert_recovered(code, rec, "")
    assert not rec["attempts"][0]["detail"]["snapshot_marked_suspect"], rec["attempts"][0]
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    assert not listing[-1]["suspect"]
    assert engines_on(policy) == [json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]]
    assert not [p for p in os.listdir("/proc") if p.isdigit() and w.name.encode() in open(f"/proc/{p}/cmdline", "rb").read()]


def _edited(policy, snap, edit):
    path = snapshots_dir(policy) / snap["id"] / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def test_a_manifest_edited_to_match_new_flags_is_refused_naming_the_field(served):
    """The policy's engine flags changed; the manifest's argv is edited to match them, so that the
    host check passes while the images hold an engine with the old flags.  Sealed with the images:
    refused before anything is restored, naming the field, and the restart recovers cold."""
    from restartkit.policy import load_policy
    from restartkit.service import Service
    policy = served()
    snap = create(policy)
    policy.write_text(policy.read_text().replace('engine_args = ["--threads", "1"]', 'engine_args = ["--threads", "2"]'))
    svc = Service(load_policy(policy))
    _edited(policy, snap, lambda m: m["identity"].update(engine_argv=svc.adapter.launch(svc.policy).argv[1:]))
    code, rec = restart(policy, "--strategy", "criu", "--strict")
    assert code == 3 and rec["served_by"] == "cold" and rec["via_recovery"], rec
    assert "manifest's identity.engine_argv was changed after the snapshot was taken" in rec["recovery_reason"], rec
    assert "criu_restore" not in (rec["attempts"][0].get("phases") or {})  # refused before CRIU ran
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    assert listing[-1]["suspect"], listing  # the snapshot's own fault: auto does not try it again


def test_an_edited_kind_is_refused(served):
    policy = served()
    snap = create(policy)
    _edited(policy, snap, lambda m: m.update(kind="weightless"))
    assert_refused(policy, "criu cannot run now")


def test_images_swapped_under_a_manifest_are_refused(served):
    policy = served()
    snap = create(policy)
    d = snapshots_dir(policy) / snap["id"]
    core = sorted(d.glob("core-*.img"))[0]
    core.write_bytes(core.read_bytes()[:-1] + b"\x00")  # one byte of another process
    code, rec = restart(policy, "--strategy", "criu", "--strict")
    assert code == 3 and rec["served_by"] == "cold", rec
    assert "not the ones its manifest was sealed with" in rec["recovery_reason"], rec["recovery_reason"]
    assert "criu_restore" not in (rec["attempts"][0].get("phases") or {})  # refused before CRIU ran
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    assert listing[-1]["suspect"], listing


def test_under_supervise_a_full_snapshot_restores_on_the_held_socket(make_policy, supervised):
    """A full snapshot (weights in the image) of an engine serving on supervise's held socket: taken beside
    supervise (the engine gives the socket up for the dump and takes it back), then a SIGKILL recovered by
    criu, the restored engine taking the held socket back; no connection refused, the same answers."""
    from restartkit.clients import ClientLoad, summarize
    policy = make_policy(extra="\n[criu]\npid_wait_s = 5.0\n")
    text = policy.read_text().replace("[restart]\n", '[restart]\nstrategies = ["criu", "cold"]\n')
    policy.write_text(text)
    port = int(text.split("port = ")[1].split()[0])
    s = supervised(policy, min_uptime_s=2.0)
    load = ClientLoad("127.0.0.1", port, "tiny", clients=2, max_tokens=2).start()
    try:
        made = run_cli("snapshot", "create", "--policy", policy, "--wait", "60", "--json")
        assert made.returncode == 0, made.stdout + made.stderr
        snap = json.loads(made.stdout)
        assert snap["kind"] != "weightless" and snap["listener"]["held"] is True, snap
        engine, rec, kill = s.crash_while_serving(2.0)
    finally:
        load.stop()
    assert rec["served_by"] == "criu" and rec["proof"]["canary_identical"], (rec["served_by"], rec["attempts"])
    assert "take_back_listener" in rec["attempts"][-1]["phases"], rec["attempts"][-1]
    got = summarize(load.snapshot(), [kill], clients=2)
    assert got["refused"] == 0 and got["http_5xx"] == 0 and got["counts"].get("ok", 0) > 10, got
    assert len({tuple(a) for a in load.answers}) == 1, got


def test_criu_without_its_capability_is_named_in_plan(make_policy):
    """CRIU run without CAP_SYS_ADMIN and CAP_CHECKPOINT_RESTORE (dropped from the bounding set here, as an
    unprivileged container would have it): plan names the capability and how to grant it, not "this kernel"."""
    import shutil
    if shutil.which("capsh") is None:
        pytest.skip("capsh (libcap2-bin) is not installed")
    policy = make_policy()
    policy.write_text(policy.read_text().replace("[restart]\n", '[restart]\nstrategies = ["criu", "cold"]\n'))
    cmd = " ".join([*map(str, RESTARTKIT), "plan", "--policy", str(policy), "--json"])
    r = subprocess.run(["capsh", "--drop=cap_sys_admin,cap_checkpoint_restore", "--", "-c", cmd],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    (criu,) = [v for v in json.loads(r.stdout)["strategies"] if v["strategy"] == "criu"]
    why = " ".join(criu["reasons"])
    assert not criu["eligible"] and "CAP_SYS_ADMIN or the CAP_CHECKPOINT_RESTORE" in why, why
    assert "setcap cap_checkpoint_restore+eip" in why and "on this kernel" not in why, why


def test_criu_without_a_writable_proc_sys_is_named_by_crius_own_line(make_policy):
    """/proc/sys read-only (a container's default): plan names CRIU's own error line and the fix, not "this
    kernel"; a refresh says the same and takes no dump."""
    policy = make_policy()
    policy.write_text(policy.read_text().replace("[restart]\n", '[restart]\nstrategies = ["criu", "cold"]\n'))
    ro = "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && "
    cli = " ".join(map(str, RESTARTKIT))
    r = subprocess.run(["unshare", "-m", "sh", "-c", ro + f"{cli} plan --policy {policy} --json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    (criu,) = [v for v in json.loads(r.stdout)["strategies"] if v["strategy"] == "criu"]
    why = " ".join(criu["reasons"])
    assert "ns_last_pid sysctl is inaccessible: Read-only file system" in why and "writable /proc/sys" in why, why
    r = subprocess.run(["unshare", "-m", "sh", "-c", ro + f"{cli} snapshot refresh --policy {policy}"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and "Read-only file system" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not list((policy.parent / "state").rglob("manifest.json"))


def test_criu_error_lines_are_read_from_its_log():
    from restartkit.snapshot.criu import first_error
    log = ("(00.001) Warn  (criu/kerndat.c:1): not a problem\n"
           "(00.002) Error (criu/cr-dump.c:2101): Dumping FAILED.\n(00.003) Error (criu/x.c:1): later\n")
    assert first_error(log) == "Dumping FAILED."
    assert first_error("Looks good.") is None


def test_a_criu_restart_beside_supervise_is_adopted_under_its_old_pid(make_policy, supervised):
    """`restartkit restart --strategy criu` while supervise watches: the restored engine comes back under the
    PID that died at the dump.  supervise adopts it (its start time differs): no crash record, no second
    restore, nothing counted toward the start limit."""
    policy = make_policy(extra="\n[criu]\npid_wait_s = 5.0\n")
    policy.write_text(policy.read_text().replace("[restart]\n", '[restart]\nstrategies = ["criu", "cold"]\n'))
    s = supervised(policy)
    before = s.status()["pid"]
    made = run_cli("snapshot", "create", "--policy", policy, "--wait", "60", "--json")
    assert made.returncode == 0, made.stdout + made.stderr
    r = run_cli("restart", "--policy", policy, "--strategy", "criu", "--wait", "60", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(r.stdout)
    assert rec["served_by"] == "criu", rec["attempts"]
    time.sleep(6)  # longer than health_misses x health_interval: a mistaken crash would have been acted on
    recs = s.records()
    assert [x["id"] for x in recs] == [rec["id"]], [(x["reason"], x["served_by"]) for x in recs]
    st = s.status()
    assert st["serving"] and st["pid"] == before and st["supervisor"]["failures_in_interval"] == 0, st


def _traced(pid: int) -> bool:
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    return int(status.split("TracerPid:")[1].split()[0]) != 0


@pytest.mark.parametrize("kill", ["command", "group"])
def test_a_snapshot_create_killed_mid_dump_under_supervise_is_reconciled_without_a_restart(make_policy, supervised,
                                                                                              kill):
    """`restartkit snapshot create` SIGKILLed while CRIU holds the engine (alone: its CRIU finishes the dump; with
    its process group: CRIU dies too) beside supervise: supervise reconciles at once (the held socket taken back,
    a frozen tree let go), no client is refused, and the engine that serves is not replaced when it can serve
    (it was, after 15.7 s, before); the next snapshot create works."""
    from restartkit.clients import ClientLoad, summarize
    policy = make_policy(extra="\n[criu]\npid_wait_s = 5.0\n")
    text = policy.read_text().replace("[restart]\n", '[restart]\nstrategies = ["criu", "cold"]\n')
    policy.write_text(text)
    port = int(text.split("port = ")[1].split()[0])
    s = supervised(policy)
    engine = s.status()["pid"]
    load = ClientLoad("127.0.0.1", port, "tiny", clients=2, max_tokens=2).start()
    try:
        made = subprocess.Popen([*RESTARTKIT, "snapshot", "create", "--policy", str(policy), "--wait", "60"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        end = time.monotonic() + 60
        while not _traced(engine) and made.poll() is None and time.monotonic() < end:
            time.sleep(0.002)
        assert made.poll() is None, "the dump ended before CRIU was seen on the engine"
        killed = time.monotonic()
        if kill == "group":
            os.killpg(made.pid, signal.SIGKILL)
        else:
            made.kill()
        made.wait(10)
        state = snapshots_dir(policy).parent / "intent.json"
        end = time.monotonic() + 60
        while state.exists() and time.monotonic() < end:  # supervise reconciles what the command left
            time.sleep(0.1)
        assert not state.exists(), s.messages
        reconciled_s = time.monotonic() - killed
        time.sleep(2.0)
    finally:
        load.stop()
    got = summarize(load.snapshot(), [killed], clients=2)
    assert got["refused"] == 0 and got["http_5xx"] == 0, got
    assert len({tuple(a) for a in load.answers}) == 1, got
    now = s.status()
    assert now["serving"], now
    crashes = [r for r in s.records() if r["reason"] == "crash"]
    if kill == "command" or now["pid"] == engine:  # it survived its CRIU: adopted, never replaced
        assert now["pid"] == engine and crashes == [], (reconciled_s, crashes)
        (rec,) = s.records()  # the interrupted command's own record, written by the reconcile
        assert "was interrupted; reconciled" in rec["recovery_reason"], rec
    else:  # CRIU killed inside it can leave it dead: then one crash restart, no more
        assert len(crashes) == 1, s.records()
    again = run_cli("snapshot", "create", "--policy", policy, "--wait", "60", "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    print(f"reconciled {reconciled_s:.2f} s after the kill; {got}")
