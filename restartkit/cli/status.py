"""`status` and `history`: what a service is doing and what was done to it (they only look)."""
from __future__ import annotations

import sys
import time

import click

from restartkit.cli.common import emit, load, service_options
from restartkit.errors import EXIT_NOT_SERVING, EXIT_SERVING
from restartkit.record import render_record


@click.command("status")
@service_options()
def status_cmd(policy_path, as_json):
    """Is the engine running, and does it answer a real completion?  It only looks: it never starts or
    stops a process, so a probe or a monitoring script may call it.  What it finds that needs acting on (an
    interrupted restart, the engines it left) comes with the command that does it.  Exit 0: serving; 1: not.

    \b
    Examples:
      restartkit status --policy llm.toml
      restartkit status --policy llm.toml --json | jq .serving
      restartkit status --policy llm.toml >/dev/null || alert   # a probe: exit 0 only while it serves"""
    from restartkit.record import read_history
    svc = load(policy_path)
    proc = svc.current()
    ready = proc is not None and svc.is_ready()
    from restartkit.supervision.state import read_state
    last = read_history(svc.state_dir, last=1)
    sup = read_state(svc.state_dir)
    from restartkit.standby import armed
    sb = armed.state(svc)
    data = {"service": svc.policy.name, "running": proc is not None, "pid": proc.pid if proc else None,
            "serving": ready, "last_restart": last[0] if last else None, "state_dir": str(svc.state_dir),
            "supervisor": sup, "standby": sb}
    text = f"{svc.policy.name}: " + ("serving" if ready else "running, not answering" if proc else "not running")
    if proc:
        text += f" (PID {proc.pid})"
    if last:
        text += f"; last restart: {last[0]['final_state']}" + (f" by {last[0]['served_by']}" if last[0].get("served_by")
                                                             else "")
    if sup:
        text += (f"\nsupervised by PID {sup['pid']} (up {time.time() - sup['started_at']:.0f} s; "
                 f"{sup['failures_in_interval']} failure(s) in the last {sup['interval_s']:.0f} s")
        if sup.get("restarts"):
            r = sup["restarts"][-1]
            text += (f"; last restart ({r['reason']}): {r['final_state']}"
                     + (f" by {r['served_by']} in {r['time_to_ready_s']} s" if r.get("served_by") else "")
                     + (f", {r['noticed_to_serving_s']} s after it was noticed"
                        if r.get("noticed_to_serving_s") is not None else ""))
        text += ")"
    if sb:
        text += f"\nstandby: PID {sb['pid']}, {sb['state']}" + (
            f" ({sb['rss_bytes'] / 1e6:.0f} MB resident)" if sb.get("rss_bytes") else "")
    data["interrupted"] = _interrupted(svc)
    if (cut := data["interrupted"]) is not None:
        left = ", ".join(f"PID {p}" for p in cut["engines_left"]) or "no engine"
        text += (f"\ninterrupted: `restartkit {cut['command']}` (PID {cut['pid']}) ended halfway and left {left}; "
                 "the next command that may act finishes it (adopts what answers, stops the rest, starts it cold "
                 "where it was to serve)")
    if not ready or cut is not None:
        data["next"] = _bring_back(svc, proc, sup, cut)
        text += f"\nnext: {data['next']}"
    emit(data, as_json, text)
    sys.exit(EXIT_SERVING if ready else EXIT_NOT_SERVING)


def _interrupted(svc) -> dict | None:
    """A command that died holding the service (its intent left behind), and the engines it left: read only."""
    from restartkit.commands.reconcile import candidates
    from restartkit.guard.intent import Intent
    stale = Intent(svc.state_dir).read_stale()
    if stale is None:
        return None
    return {"command": stale.get("command"), "pid": stale.get("pid"), "started_at": stale.get("started_at"),
            "engines_left": candidates(svc, stale)}


def _bring_back(svc, proc, sup, cut: dict | None = None) -> str:
    """The command that brings a service that does not serve back, or finishes an interrupted one (status
    says it; it runs nothing itself)."""
    policy = svc.policy.path
    if sup and sup.get("pid") and _alive(sup["pid"]):
        return f"supervise (PID {sup['pid']}) brings it back by itself"
    if cut is not None:
        return (f"restartkit start --policy {policy} (finishes the interrupted `restartkit {cut['command']}`"
                + (", then finds it running)" if proc is not None else ")"))
    if proc is not None:
        return f"restartkit restart --policy {policy} (it runs but does not answer)"
    return (f"restartkit start --policy {policy}, or restartkit supervise --policy {policy} to keep it serving "
            "across crashes")


def _alive(pid: int) -> bool:
    from restartkit.process.procfs import exited
    return not exited(pid)


@click.command("history")
@service_options()
@click.option("--last", type=click.IntRange(min=0), default=10, show_default=True, help="0: all.")
def history_cmd(policy_path, last, as_json):
    """The last restart records of a service.

    \b
    Examples:
      restartkit history --policy llm.toml
      restartkit history --policy llm.toml --last 0 --json"""
    from restartkit.record import load_history
    svc = load(policy_path)
    got = load_history(svc.state_dir, last)
    text = "\n".join(render_record(r) for r in got.records) or "no restarts recorded"
    if note := got.note():
        text += f"\n({note})"
    emit({"records": got.records, "skipped": got.skipped, "problem": got.problem}, as_json, text)
