"""`restartkit demo`: the main job end to end on the embedded reference model.

Creates a small seeded checkpoint, starts the reference engine on the CPU
under the demo policy (sleep mode on), starts a weight cache for it, takes a
CRIU snapshot where this host allows one, shows the plan, restarts with
--strategy auto, prints the record, and benches every strategy that can run
here.  Everything it started is stopped at the end."""
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
        from restartkit.reference.checkpoint import write_checkpoint
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
    stop_weight_cache(svc.policy)
    say(f"\nthe demo engine and its weight cache were stopped; start again with: restartkit start --policy {policy_path}")
    say(f"records: {svc.state_dir / 'history.jsonl'}; metrics: {svc.state_dir / 'metrics.prom'}")
    return EXIT_SERVING if rec.final_state == "serving" else EXIT_NOT_SERVING


def _try_snapshot(svc, say) -> None:
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
