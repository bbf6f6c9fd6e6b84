"""`restartkit demo`: the main job end to end on the embedded reference model.

Creates a small seeded checkpoint, starts the reference engine on the CPU
under the demo policy (sleep mode on), starts a weight cache for it, takes a
CRIU snapshot where this host allows one, shows the plan, restarts with
--strategy auto, prints the record, and benches every strategy that can run
here.  It ends with a crash under `restartkit supervise`: the service's socket held, a standby armed,
4 clients that never retry, the serving engine SIGKILLed; it prints the time from the kill to the next
answer and how many connections were refused.  Everything it started is stopped at the end."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from restartkit.errors import EXIT_NOT_SERVING, EXIT_SERVING

DEFAULT_WORKDIR = "~/.cache/restartkit/demo"

# policies/demo.toml is this template with the default workdir (a test keeps them equal).
DEMO_POLICY = """\
# The demo service: the tiny reference model on the CPU.
# `restartkit demo` creates the model and runs everything below on its own.
[service]
name = "demo"
engine = "reference"
model = "{workdir}/models/small"
host = "127.0.0.1"
port = {port}
device = "cpu"
max_model_len = 512
engine_args = ["--threads", "1"]

[restart]
strategies = ["auto"]
start_timeout_s = 120
stop_timeout_s = 15
canary_prompts = ["The quick brown fox", "Restarting an inference server"]
canary_max_tokens = 16

[ipc]
# copy mode: the engine owns its weights, so sleep mode can park them
mode = "copy"
fallback = true

[criu]
keep = 2
max_age_h = 24

[sleep]
enabled = true
level = 1
"""


SUPERVISED_MIN_UPTIME_S = 2.0
# The demo's last act: the same model under supervise, its weights mapped from the weight cache
# (zero_copy, which a standby needs) and a standby armed.
SUPERVISED_POLICY = """\
[service]
name = "demo-supervised"
engine = "reference"
model = "{workdir}/models/small"
host = "127.0.0.1"
port = {port}
device = "cpu"
max_model_len = 512
engine_args = ["--threads", "1"]

[restart]
start_timeout_s = 120
stop_timeout_s = 15
canary_prompts = ["The quick brown fox"]
canary_max_tokens = 8

[ipc]
mode = "zero_copy"
fallback = true

[standby]
enabled = true
kv_ahead = "never"

[front]
engine_port = {engine_port}

[supervise]
health_interval_s = 1
min_uptime_s = %s
""" % SUPERVISED_MIN_UPTIME_S

DEFAULT_PORT = 8199


def run_demo(workdir: str = DEFAULT_WORKDIR, repeat: int = 2, say: Callable[[str], None] = print,
             state_root: str = "", port: int = DEFAULT_PORT) -> int:
    """`state_root`: where the demo service's state dir lives (default: in the workdir); `port`: the
    demo engine's (another one when 8199 is taken)."""
    from restartkit.commands.bench import render_bench, run_bench
    from restartkit.planner import render_plan
    from restartkit.record import render_record
    from restartkit.restart import plan_for, restart
    from restartkit.service import Service
    from restartkit.weightcache.prelaunch import start_weight_cache, stop_weight_cache

    root = Path(os.path.expanduser(workdir))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "models" / "small"
    if not (model_dir / "config.json").exists():
        from restartkit.reference.model.checkpoint import write_checkpoint
        say(f"== creating the small reference checkpoint in {model_dir}")
        write_checkpoint(model_dir, "small")
    policy_path = root / "demo.toml"
    policy_path.write_text(DEMO_POLICY.format(workdir=workdir, port=port))
    svc = Service.from_policy_file(policy_path, state_root or str(root / "state"))

    say(f"== starting the reference engine (policy {policy_path})")
    svc.engine.stop()
    started = svc.engine.start("cold")
    svc.canary()
    say(f"serving on {svc.adapter.base_url(svc.policy)} (PID {started.process.pid}) after {started.ready_s:.2f} s")

    say(f"\n== restartkit preload --policy {policy_path} --detach   (the weight cache, for ipc)")
    start_weight_cache(svc.policy, say)

    say(f"\n== restartkit snapshot create --policy {policy_path}   (for criu)")
    _try_snapshot(svc, say)

    say("\n== restartkit plan --strategy auto")
    plan, _ = plan_for(svc, "auto", "restart")
    say(render_plan(plan))

    say("\n== restartkit restart --strategy auto")
    rec = restart(svc, "auto", "restart", strict=False, say=say)
    say(render_record(rec.to_dict()))

    runnable = [name for name in plan.order if plan.verdicts[name].eligible]
    say(f"\n== restartkit bench --strategies {','.join(runnable)} --repeat {repeat}")
    result = run_bench(svc, runnable, repeat, str(root / "bench"), say=say)
    say(render_bench(result))
    not_here = [f"{n}: {plan.verdicts[n].reasons[0]}" for n in plan.order if not plan.verdicts[n].eligible]
    if not_here:
        say("not benched here: " + "; ".join(not_here))
    say("(the demo's model is small: its weights load from disk in milliseconds, so ipc and criu have little to save "
        "here; with 16 GB of weights on an H200, one run measured ipc ready in 4.3 s against 7.2-7.5 s cold: "
        "docs/BENCHMARKS.md)")
    svc.engine.stop()
    say(f"\n== restartkit supervise --policy {root / 'demo-supervised.toml'}   (the socket held, a standby "
        "armed; then a crash)")
    crash_ok = _crash_under_supervise(root, workdir, port, state_root or str(root / "state"), say)
    stop_weight_cache(svc.policy)
    say(f"\nthe demo engine and its weight cache were stopped; start again with: restartkit start --policy {policy_path}")
    say(f"records: {svc.state_dir / 'history.jsonl'}; metrics: {svc.state_dir / 'metrics.prom'}")
    return EXIT_SERVING if rec.final_state == "serving" and crash_ok else EXIT_NOT_SERVING


def _crash_under_supervise(root: Path, workdir: str, port: int, state_root: str, say) -> bool:
    """supervise on the demo's port with a standby on the weight cache; 4 clients that open a new
    connection per request and never retry; one SIGKILL of the serving engine.  True when the service
    answered again after it."""
    import signal
    import subprocess
    import sys
    import time

    from restartkit.clients import ClientLoad, summarize
    from restartkit.standby.armed import state as standby_state
    from restartkit.record import read_history
    from restartkit.service import Service

    policy_path = root / "demo-supervised.toml"
    front_port = port  # the front answers on the service's port; the engines serve behind it on a free one
    policy_path.write_text(SUPERVISED_POLICY.format(workdir=workdir, port=port, engine_port=_free_port()))
    svc = Service.from_policy_file(policy_path, state_root)
    log = open(root / "supervise.log", "w")
    sup = subprocess.Popen([sys.executable, "-m", "restartkit.cli", "supervise", "--policy", str(policy_path)],
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                           env={**os.environ, "RESTARTKIT_STATE_DIR": state_root})
    load = None
    try:
        armed = _wait(lambda: (sb := standby_state(svc)) and sb["state"] == "prepared" and svc.is_ready() and sb,
                      120, sup)
        engine = svc.current()
        say(f"serving (PID {engine.pid}) on the socket supervise holds; standby PID {armed['pid']} armed")
        load = ClientLoad(svc.policy.service["host"], front_port, svc.adapter.served_name(svc.policy), clients=4,
                          max_tokens=32).start()
        time.sleep(max(0.0, SUPERVISED_MIN_UPTIME_S + 0.5 - (time.time() - (engine.create_time or 0.0))))
        kill, killed_at = time.monotonic(), time.time()
        os.kill(engine.pid, signal.SIGKILL)
        say(f"SIGKILL -> PID {engine.pid}, 4 clients sending through the front on port {front_port} (a new "
            "connection per request, no retries)")
        _wait(lambda: (p := svc.current()) and p.pid != engine.pid and svc.is_ready(), 120, sup)
        time.sleep(1.0)
        load.stop()
        got = summarize(load.snapshot(), [kill], clients=4)
        served_by = _wait(lambda: [r for r in read_history(svc.state_dir) if r.get("started_at", 0) >= killed_at], 30, sup)[-1]["served_by"]
        after = got["kill_to_answer_s"][0]
        say((f"answering again {after:.2f} s after the kill, served by {served_by}" if after is not None else
             "no answer after the kill") + f"; the clients' {got['requests']} requests: {got['refused']} connections "
            f"refused, {got['http_5xx']} HTTP 5xx, {got['lost']} lost (in flight on the killed engine: the front continues them), longest wait "
            f"{got['longest_wait_s']:.2f} s")
        return after is not None
    except TimeoutError as e:
        say(f"the crash under supervise could not be shown: {e} (its log: {root / 'supervise.log'})")
        return False
    finally:
        if load is not None:
            load.stop()
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGTERM)
            try:
                sup.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(sup.pid, signal.SIGKILL)
        log.close()
        svc.engine.stop()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what, timeout_s: float, sup):
    import time
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if got := what():
            return got
        if sup.poll() is not None:
            raise TimeoutError(f"supervise exited with {sup.returncode}")
        time.sleep(0.1)
    raise TimeoutError(f"not within {timeout_s:.0f} s")


def _try_snapshot(svc, say) -> None:
    from restartkit.snapshot.ops import snapshot_metrics
    try:
        _snapshot_and_test(svc, say)
    finally:
        snapshot_metrics(svc)  # snapshot.prom, as `restartkit snapshot create` and `snapshot test` write it


def _snapshot_and_test(svc, say) -> None:
    from restartkit.restart import gather_facts, snapshot_problems
    from restartkit.snapshot.ops import create
    facts = gather_facts(svc, "restart")
    if reasons := snapshot_problems(facts, svc.policy):
        say("no snapshot on this host: " + "; ".join(reasons))
        return
    try:
        snap = create(svc, facts, leave_running=True)
        say(f"snapshot {snap.id}: {snap.manifest['image_bytes'] / 1e6:.0f} MB, dumped in {snap.manifest['phases']['criu_dump']:.2f} s")
    except Exception as e:
        say(f"snapshot failed: {e}")
        return
    from restartkit.snapshot.trial import test_restore, why_not
    if problem := why_not(snap.manifest, facts.host.criu.path, svc.policy.service["host"]):
        say(f"no test restore here: {problem}")
        return
    say(f"\n== restartkit snapshot test --policy {svc.policy.path}   (a copy restored beside the engine)")
    try:
        r = test_restore(svc, facts, snap)
        say(f"the copy answered the canary {'identically' if r['ok'] else 'NOT identically: ' + str(r.get('error'))} "
            f"in {r['wall_s']:.2f} s, then died with its namespaces; the engine kept serving")
    except Exception as e:
        say(f"test restore could not run: {getattr(e, 'message', None) or e}")
