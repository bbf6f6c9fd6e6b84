"""Faults injected for real into a serving tiny reference engine: signals to
restartkit halfway, a read-only state dir, two commands at once, a neighbour
on the port, a stopped or killed restored engine, a hung old engine, a clock
step, weights rewritten in place.  Each test checks the outcome, the record,
the snapshot's state and that nothing is left behind (one engine on the port,
no intent, the lock free, no partial image)."""
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from restartkit.facts import criu_facts
from tests.helpers import RESTARTKIT, ROOT, create, engines_on, run_cli, snapshots_dir

CRIU = criu_facts()
pytestmark = pytest.mark.slow
needs_criu = [pytest.mark.root, pytest.mark.skipif(os.getuid() != 0, reason="CRIU needs root"),
              pytest.mark.skipif(not CRIU.check_ok, reason=f"no working CRIU here ({CRIU.source})")]
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="mount namespaces need root")


@pytest.fixture
def served(make_policy, service_cleanup):
    def make(extra="", criu_extra="pid_wait_s = 5.0\n"):
        policy = make_policy(extra=extra + "\n[criu]\n" + criu_extra)
        service_cleanup(policy)
        r = run_cli("start", "--policy", policy)
        assert r.returncode == 0, r.stderr
        return policy
    return make


def state_dir(policy):
    return policy.parent / "state" / "svc"


def status(policy) -> dict:
    return json.loads(run_cli("status", "--policy", policy, "--json").stdout)


def spawn(*args) -> subprocess.Popen:
    """restartkit in its own process group, as a shell job is (`kill %1` signals the group)."""
    return subprocess.Popen([*RESTARTKIT, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, start_new_session=True)


def wait_for_line(proc, words, timeout=60) -> str:
    deadline = time.monotonic() + timeout
    for line in proc.stderr:
        if words in line:
            return line
        assert time.monotonic() < deadline, f"no {words!r} within {timeout} s"
    raise AssertionError(f"restartkit ended before saying {words!r}")


def assert_clean(policy, serving=True):
    """Nothing leaked: one engine (the recorded one) on the port, no intent, the lock free, no partial image."""
    st = status(policy)
    assert st["serving"] is serving, st
    engines = engines_on(policy)
    assert engines == ([st["pid"]] if serving else []), (engines, st)
    assert not (state_dir(policy) / "intent.json").exists()
    fd = os.open(state_dir(policy) / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if anyone still holds it
    finally:
        os.close(fd)
    snaps = snapshots_dir(policy)
    if snaps.is_dir():
        partial = [d.name for d in snaps.iterdir() if d.is_dir() and not d.is_symlink()
                   and not (d / "manifest.json").exists()]
        assert not partial, partial


def snapshot_listing(policy) -> list[dict]:
    return json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]


def last_record(policy) -> dict:
    return json.loads(run_cli("history", "--policy", policy, "--last", "1", "--json").stdout)["records"][-1]


def criu_wrapper(tmp_path, after_restore: str):
    """A CRIU that runs the real one, then does `after_restore` to the restored PID ($PID)."""
    w = tmp_path / "criu-wrapper"
    w.write_text(f"""#!/bin/sh
pidfile=""
prev=""
for a in "$@"; do [ "$prev" = --pidfile ] && pidfile=$a; prev=$a; done
{CRIU.path} "$@"; rc=$?
if [ "$1" = restore ] && [ $rc = 0 ] && [ -n "$pidfile" ]; then PID=$(cat "$pidfile"); {after_restore}; fi
exit $rc
""")
    w.chmod(0o755)
    return w


def use_criu(policy, path):
    policy.write_text(policy.read_text().replace("[criu]\n", f'[criu]\ncriu_path = "{path}"\n'))


# ---- signals to restartkit halfway -------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_a_criu_restart_ends_it_at_a_safe_point(served, sig):
    """The restart ends at its next wait (what it restored killed, the record saying so, exit
    128+N), or, when it reached none before serving, finishes; either way the next command finds
    the service clean and serving, and the snapshot is not blamed."""
    if os.getuid() != 0 or not CRIU.check_ok:
        pytest.skip("needs root and a working CRIU")
    policy = served()
    create(policy)
    p = spawn("restart", "--policy", policy, "--strategy", "criu")
    wait_for_line(p, "running criu")
    t0 = time.monotonic()
    os.killpg(p.pid, sig)  # the whole job, as `kill %1` or Ctrl-C does
    out, err = p.communicate(timeout=120)
    assert time.monotonic() - t0 < 15  # stop_timeout_s and a few seconds
    assert "Traceback" not in err, err
    name = signal.Signals(sig).name
    assert f"{name} received: ending" in err
    rec = last_record(policy)  # before the next command reconciles
    if p.returncode == 0:
        assert rec["served_by"] == "criu" and rec["proof"]["canary_identical"] is True, rec
    else:
        assert p.returncode == 128 + sig and rec["attempts"][-1]["interrupted"] == name, (p.returncode, rec)
        assert engines_on(policy) == [] or rec["final_state"] == "serving"
    assert run_cli("start", "--policy", policy).returncode == 0  # reconciles a cut restart: it serves again
    assert_clean(policy)
    assert not snapshot_listing(policy)[-1]["suspect"]


def test_sigkill_during_a_criu_restore_is_reconciled_by_the_next_command(served, tmp_path):
    if os.getuid() != 0 or not CRIU.check_ok:
        pytest.skip("needs root and a working CRIU")
    # CRIU held 3 s after its restore ends: the SIGKILL lands while restart waits on it, however fast the restore
    # (a tiny engine restores in ~0.2 s: a plain sleep before the kill sometimes found the restart done)
    wrapper = tmp_path / "criu-held"
    wrapper.write_text(f'#!/bin/sh\n{CRIU.path} "$@"\nrc=$?\n[ "$1" = restore ] && sleep 3\nexit $rc\n')
    wrapper.chmod(0o755)
    policy = served(criu_extra=f'pid_wait_s = 5.0\ncriu_path = "{wrapper}"\n')
    snap = create(policy)
    p = spawn("restart", "--policy", policy, "--strategy", "criu")
    wait_for_line(p, "running criu")
    time.sleep(0.3)  # inside the restore, or just after it (CRIU's wrapper still holds)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)
    assert (state_dir(policy) / "intent.json").exists()
    st = status(policy)  # reports the killed restart and names the command that finishes it; acts on nothing
    assert st["interrupted"]["command"] == "restart" and st["next"].startswith("restartkit start"), st
    assert (state_dir(policy) / "intent.json").exists()
    r = run_cli("start", "--policy", policy, "--json")
    assert "interrupted `restartkit restart`" in r.stderr and "reconciling" in r.stderr, r.stderr
    assert status(policy)["serving"], r.stdout + r.stderr
    assert_clean(policy)
    rec = last_record(policy)
    assert rec["final_state"] == "serving" and "was interrupted" in rec["recovery_reason"], rec
    # the next restart is an ordinary one: no "PIDs taken", no "port in use", the snapshot unmarked
    r = run_cli("restart", "--policy", policy, "--strategy", "criu", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not snapshot_listing(policy)[-1]["suspect"] and snapshot_listing(policy)[-1]["id"] == snap["id"]
    assert_clean(policy)


def test_sigkill_after_the_kv_cache_drop_of_a_snapshot_is_given_back(served):
    if os.getuid() != 0 or not CRIU.check_ok:
        pytest.skip("needs root and a working CRIU")
    policy = served()
    pid = status(policy)["pid"]
    p = spawn("snapshot", "create", "--policy", policy)
    wait_for_line(p, "dumping PID")  # the KV cache was dropped just before
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)
    subprocess.run(["pkill", "-KILL", "-f", f"criu dump --tree {pid}"], check=False)
    time.sleep(0.5)
    assert run_cli("start", "--policy", policy).returncode == 0  # reconciles: the KV cache back, the engine adopted
    st = status(policy)
    assert st["serving"] and st["pid"] == pid, st
    assert_clean(policy)


def test_sigterm_during_create_rolls_back_without_a_traceback(served):
    if os.getuid() != 0 or not CRIU.check_ok:
        pytest.skip("needs root and a working CRIU")
    policy = served()
    first = create(policy)
    p = spawn("snapshot", "create", "--policy", policy)
    wait_for_line(p, "taking the canary")
    os.killpg(p.pid, signal.SIGTERM)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert "interrupted by SIGTERM" in err
    assert [s["id"] for s in snapshot_listing(policy) if s["current"]] == [first["id"]]
    assert_clean(policy)


# ---- the state dir -------------------------------------------------------------------------

@needs_root
@pytest.mark.parametrize("fault,strategy", [("read-only", "cold"), ("read-only", "auto"), ("immutable", "auto"),
                                            ("full", "cold")])
def test_a_state_dir_that_cannot_be_written_refuses_before_touching_the_engine(served, fault, strategy):
    policy = served("\n[sleep]\nenabled = true\n")
    before = status(policy)["pid"]
    sd = state_dir(policy)
    cmd = " ".join(map(str, [*RESTARTKIT, "restart", "--policy", policy, "--strategy", strategy]))
    if fault == "read-only":
        script = f"mount --bind {sd} {sd} && mount -o remount,bind,ro {sd} && exec {cmd}"
    elif fault == "full":  # a small filesystem holding the state dir's files, filled up
        script = (f"cp -a {sd} {sd}.copy && mount -t tmpfs -o size=512k tmpfs {sd} && cp -a {sd}.copy/. {sd}/ && "
                  f"rm -rf {sd}.copy && (dd if=/dev/zero of={sd}/filler bs=4k 2>/dev/null; true) && exec {cmd}")
    else:
        script = f"chattr +i {sd} && {cmd}; rc=$?; chattr -i {sd}; exit $rc"
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    if fault == "immutable" and "Operation not supported" in r.stderr:
        pytest.skip("this filesystem has no immutable flag")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"the state dir {sd} is not writable" in r.stderr and "nothing was touched" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    st = status(policy)
    assert st["serving"] and st["pid"] == before  # the healthy engine was never stopped
    assert_clean(policy)


def test_a_record_that_cannot_be_written_is_reported_not_lost(served):
    policy = served()
    hist = state_dir(policy) / "history.jsonl"
    hist.unlink(missing_ok=True)
    hist.mkdir()  # appending to it fails; the state dir itself stays writable
    r = run_cli("restart", "--policy", policy, "--strategy", "cold")
    assert r.returncode == 0, r.stderr  # the restart served: a record problem does not fail it
    assert "could not write the record of restart" in r.stderr and '"final_state": "serving"' in r.stderr, r.stderr
    hist.rmdir()
    assert_clean(policy)


# ---- two commands at once --------------------------------------------------------------------

def test_two_restarts_at_once_one_is_busy_then_with_wait_both_serve(served):
    policy = served()
    a = spawn("restart", "--policy", policy, "--strategy", "cold")
    wait_for_line(a, "running cold")
    b = run_cli("restart", "--policy", policy, "--strategy", "cold")
    assert b.returncode == 75, b.stdout + b.stderr
    assert f"busy: PID {a.pid} runs `restartkit restart` on svc" in b.stderr and "--wait" in b.stderr, b.stderr
    a.communicate(timeout=120)
    assert a.returncode == 0
    c = spawn("restart", "--policy", policy, "--strategy", "cold")
    wait_for_line(c, "running cold")
    d = run_cli("restart", "--policy", policy, "--strategy", "cold", "--wait", "120")
    c.communicate(timeout=120)
    assert c.returncode == 0 and d.returncode == 0, d.stderr
    assert "waiting up to 120 s" in d.stderr
    assert_clean(policy)


def test_a_stop_during_a_restart_waits_its_turn(served):
    policy = served()
    a = spawn("restart", "--policy", policy, "--strategy", "cold")
    wait_for_line(a, "running cold")
    r = run_cli("stop", "--policy", policy, "--wait", "120")
    a.communicate(timeout=120)
    assert a.returncode == 0 and r.returncode == 0, r.stderr
    assert_clean(policy, serving=False)


# ---- the port, the PIDs and the snapshot's good name ---------------------------------------------

def test_a_neighbour_on_the_port_is_named_and_the_snapshot_stays_good(served, tmp_path):
    if os.getuid() != 0 or not CRIU.check_ok:
        pytest.skip("needs root and a working CRIU")
    policy = served()
    create(policy)
    assert run_cli("stop", "--policy", policy).returncode == 0
    port = policy.read_text().split("port = ")[1].split()[0]
    neighbour = subprocess.Popen([sys.executable, "-m", "http.server", port, "--bind", "127.0.0.1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        time.sleep(1.0)
        r = run_cli("restart", "--policy", policy, "--json")
        rec = json.loads(r.stdout)
        assert r.returncode == 1, rec
        assert rec["attempts"][0]["strategy"] == "criu" and f"port {port} is already in use by PID {neighbour.pid}" in rec["attempts"][0]["error"]
        assert not snapshot_listing(policy)[-1]["suspect"]  # not the snapshot's fault
        assert neighbour.poll() is None  # someone else's process is left alone
    finally:
        neighbour.kill()
        neighbour.wait()
    assert run_cli("restart", "--policy", policy, "--strategy", "criu", "--strict").returncode == 0
    assert_clean(policy)


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_restored_engine_stopped_or_killed_by_someone_else_is_cleared_before_recovery(served, tmp_path, fault):
    if os.getuid() != 0 or not CRIU.check_ok:
        pytest.skip("needs root and a working CRIU")
    policy = served()
    create(policy)
    use_criu(policy, criu_wrapper(tmp_path, f"kill -{fault[3:]} $PID"))
    policy.write_text(policy.read_text().replace("start_timeout_s = 60", "start_timeout_s = 8"))
    t0 = time.monotonic()
    r = run_cli("restart", "--policy", policy, "--strategy", "criu", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "cold" and rec["via_recovery"], rec
    assert rec["proof"]["canary_identical"] is True
    assert time.monotonic() - t0 < 60  # bounded by the policy's deadlines, not CRIU's 600 s
    assert "already in use" not in json.dumps(rec)  # the recovery found the port free
    assert not snapshot_listing(policy)[-1]["suspect"]  # someone else's doing, not the snapshot's
    assert_clean(policy)


@pytest.mark.parametrize("crash", ["SIGSEGV", "SIGBUS", "SIGABRT"])
def test_a_restored_engine_that_crashes_on_its_own_marks_the_snapshot(served, tmp_path, crash):
    """Damaged pages that CRIU restores without complaint kill the engine when it touches them (a
    crash signal of its own: here sent as the kernel would).  That is the snapshot's fault: it is
    marked, so auto does not try it again; a kill or a stop by someone else is not (above)."""
    if os.getuid() != 0 or not CRIU.check_ok:
        pytest.skip("needs root and a working CRIU")
    policy = served()
    snap = create(policy)
    use_criu(policy, criu_wrapper(tmp_path, f"kill -{crash[3:]} $PID"))
    r = run_cli("restart", "--policy", policy, "--strategy", "criu", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "cold" and rec["via_recovery"], rec
    assert "on its own: its snapshot is at fault" in rec["attempts"][0]["error"], rec["attempts"][0]
    listing = snapshot_listing(policy)
    assert listing[-1]["id"] == snap["id"] and listing[-1]["suspect"], listing[-1]
    assert json.loads(run_cli("plan", "--policy", policy, "--json").stdout)["attempt"] != "criu"
    assert_clean(policy)


def test_zeroed_pages_mark_the_snapshot_and_recovery_still_serves(served):
    if os.getuid() != 0 or not CRIU.check_ok:
        pytest.skip("needs root and a working CRIU")
    policy = served()
    policy.write_text(policy.read_text().replace("start_timeout_s = 60", "start_timeout_s = 15"))
    snap = create(policy)
    pages = max((snapshots_dir(policy) / snap["id"]).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    size = pages.stat().st_size
    with open(pages, "r+b") as f:
        f.write(b"\0" * size)  # same size: the cheap damage check cannot see it
    r = run_cli("restart", "--policy", policy, "--strategy", "criu", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "cold" and rec["via_recovery"], rec
    assert "already in use" not in json.dumps(rec)
    assert_clean(policy)
    # the snapshot did not restore to a working engine: whether CRIU refused the images (marked) or the
    # engine it restored never answered (killed, not marked), it is never the current engine
    listing = snapshot_listing(policy)
    assert listing[-1]["id"] == snap["id"]


def test_a_passing_snapshot_test_clears_a_suspect_mark(served):
    if os.getuid() != 0 or not CRIU.check_ok:
        pytest.skip("needs root and a working CRIU")
    policy = served()
    snap = create(policy)
    manifest = snapshots_dir(policy) / snap["id"] / "manifest.json"
    m = json.loads(manifest.read_text())
    m["suspect"] = {"reason": "restore of snapshot failed: injected", "at": time.time()}
    manifest.write_text(json.dumps(m))
    r = run_cli("snapshot", "list", "--policy", policy)
    assert "SUSPECT: restore of snapshot failed: injected" in r.stdout  # list says why
    assert run_cli("snapshot", "test", "--policy", policy).returncode == 0
    assert not snapshot_listing(policy)[-1]["suspect"]
    assert_clean(policy)


# ---- hangs -----------------------------------------------------------------------------------------

def test_a_hung_old_engine_is_killed_and_facts_stay_fast(served):
    policy = served()
    old = status(policy)["pid"]
    os.kill(old, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = run_cli("plan", "--policy", policy, "--json")
        assert r.returncode == 0 and time.monotonic() - t0 < 15, r.stderr  # fact gathering is bounded
        r = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")
        rec = json.loads(r.stdout)
        assert r.returncode == 0 and rec["served_by"] == "cold", rec
        assert not os.path.exists(f"/proc/{old}") or open(f"/proc/{old}/stat").read().split(") ")[1][0] == "Z"
    finally:
        try:
            os.kill(old, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert_clean(policy)


# ---- identity: a clock step ----------------------------------------------------------------------

@needs_root
def test_a_clock_step_does_not_lose_the_engine(served, tmp_path):
    policy = served()
    pid = status(policy)["pid"]
    stat = open("/proc/stat").read().splitlines()
    fake = tmp_path / "stat"
    fake.write_text("\n".join(f"btime {int(l.split()[1]) + 5}" if l.startswith("btime") else l for l in stat) + "\n")
    cmd = " ".join(map(str, [*RESTARTKIT, "status", "--policy", policy, "--json"]))
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {fake} /proc/stat && exec {cmd}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    out = json.loads(r.stdout)
    assert out["serving"] and out["pid"] == pid, r.stdout + r.stderr
    assert (state_dir(policy) / "engine.json").exists()
    assert_clean(policy)


# ---- weights changed under the service -------------------------------------------------------------

def test_a_shard_rewritten_in_place_with_its_mtime_kept_changes_the_digest(tmp_path):
    from restartkit.reference.model.checkpoint import write_checkpoint
    from restartkit.weightcache.fingerprint import checkpoint_digest
    a = write_checkpoint(tmp_path / "a", "tiny", seed=0)
    b = write_checkpoint(tmp_path / "b", "tiny", seed=1)
    before = checkpoint_digest(a)[0]
    for shard in sorted(a.glob("*.safetensors")):
        st = shard.stat()
        other = (b / shard.name).read_bytes()
        assert len(other) == st.st_size
        with open(shard, "r+b") as f:  # same inode, same size
            f.write(other)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back, as `cp -p` does
        assert shard.stat().st_ino == st.st_ino and shard.stat().st_mtime_ns == st.st_mtime_ns
    assert checkpoint_digest(a)[0] == checkpoint_digest(b)[0] != before


def test_a_running_engine_keeps_its_weights_when_the_file_changes_under_it(make_policy, service_cleanup, tmp_path):
    from restartkit.reference.model.checkpoint import write_checkpoint
    model = write_checkpoint(tmp_path / "m", "tiny", seed=0)
    other = write_checkpoint(tmp_path / "o", "tiny", seed=1)
    policy = make_policy(model=str(model))
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    canary = json.loads((state_dir(policy) / "canary.json").read_text())["tokens"]
    for shard in sorted(model.glob("*.safetensors")):
        with open(shard, "r+b") as f:
            f.write((other / shard.name).read_bytes())
    from restartkit.engines.reference import ReferenceAdapter
    from restartkit.policy import load_policy
    assert ReferenceAdapter().canary(load_policy(policy)) == canary


@needs_root
def test_a_full_images_disk_is_named_at_the_dump(served):
    """CRIU itself says 'Error(0): Unknown' when the images' disk fills up during a dump."""
    policy = served()
    before = status(policy)["pid"]
    images = state_dir(policy) / "snapshots"
    images.mkdir(mode=0o700, exist_ok=True)
    cmd = " ".join(map(str, [*RESTARTKIT, "snapshot", "create", "--policy", policy]))
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=8m,mode=0700 tmpfs {images} && exec {cmd}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert f"no space left on the disk of {images}" in r.stderr and "ENOSPC" in r.stderr, r.stderr
    st = status(policy)
    assert st["serving"] and st["pid"] == before  # the engine was put back and keeps serving
    assert_clean(policy)


def _zombie_on(pid: int) -> subprocess.Popen:
    """A zombie under `pid` whose parent (returned) never collects it (root: steer the kernel's next PID)."""
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 2))
        parent = subprocess.Popen(["sh", "-c", "sleep 0 & exec sleep 300"])
        for _ in range(100):
            try:
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                state = None
            if state and state[0] == "Z" and int(state[1]) == parent.pid:
                return parent
            time.sleep(0.01)
        parent.kill()
        parent.wait()
    pytest.skip(f"could not leave a zombie under PID {pid}")


@needs_root
def test_a_zombie_on_a_snapshots_pid_is_named_without_waiting_out_pid_wait(served):
    """A zombie's PID is free only when its parent collects it: waiting out pid_wait_s (26.7 s once)
    buys nothing.  Named with its parent after a short grace (restore.ZOMBIE_GRACE_S), left alone, and the
    restart recovers."""
    policy = served(criu_extra='pid_wait_s = 60.0\n')
    snap = create(policy, "--stop")
    parent = _zombie_on(snap["pid"])
    try:
        t0 = time.monotonic()
        r = run_cli("restart", "--policy", policy, "--strategy", "criu", "--json")
        rec = json.loads(r.stdout)
        assert rec["served_by"] == "cold" and rec["via_recovery"], rec
        assert f"a zombie its parent PID {parent.pid} has not collected" in rec["recovery_reason"], rec["recovery_reason"]
        assert time.monotonic() - t0 < 50  # pid_wait_s is 60: it was waited out
        assert parent.poll() is None  # not ours: left alone
    finally:
        parent.kill()
        parent.wait()


@needs_root
def test_stop_works_on_a_full_state_dir(make_policy, service_cleanup, tmp_path):
    """What an operator reaches for on a full disk: stop stops the engine anyway (its intent and the lock's holder
    line are advice it goes without); start still refuses there, naming the dir."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(disk)], check=True)
    try:
        policy = make_policy()
        policy.write_text(policy.read_text().replace(str(tmp_path / "state"), str(disk / "state")))
        service_cleanup(policy)
        assert run_cli("start", "--policy", policy).returncode == 0
        pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
        fill(disk / "filler")
        r = run_cli("stop", "--policy", policy)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}")
        fill(disk / "filler2")  # what the stop freed (engine.json, the lock's line)
        r = run_cli("start", "--policy", policy)
        assert r.returncode == 2 and "is not writable" in r.stderr, r.stdout + r.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def fill(path) -> None:
    """Write to `path` until its disk is full, to the last block."""
    with open(path, "wb", buffering=0) as f:
        for size in (65536, 4096, 512, 1):
            try:
                while True:
                    f.write(b"x" * size)
            except OSError:
                pass
