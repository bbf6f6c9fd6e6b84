"""`snapshot create|restore|list|inspect`: CRIU snapshots of a running engine (the criu strategy)."""
from __future__ import annotations

import click

from restartkit.cli.common import emit, guarded, load, restart_and_exit, say, service_options


@click.group("snapshot")
def snapshot_group():
    """CRIU snapshots of a running engine (the criu strategy)."""


def snapshot_context(policy_path_or_service):
    from restartkit.restart import gather_facts
    svc = load(policy_path_or_service) if isinstance(policy_path_or_service, str) else policy_path_or_service
    return svc, gather_facts(svc, "restart")


def _require_snapshot_prereqs(svc, facts):
    from restartkit.errors import StrategyError
    from restartkit.restart import snapshot_problems
    if reasons := snapshot_problems(facts, svc.policy):
        raise StrategyError("a snapshot cannot be taken here: " + "; ".join(reasons))


@snapshot_group.command("create")
@service_options(wait=True)
@click.option("--stop", "stop_engine", is_flag=True, help="Let the engine die with the dump (default: it keeps running).")
def snapshot_create(policy_path, stop_engine, wait_s, as_json):
    """Snapshot the running engine (KV cache dropped first, put back after).

    \b
    Examples:
      restartkit snapshot create --policy llm.toml
      restartkit snapshot create --policy llm.toml --json   # its size, how long the engine was paused"""
    from restartkit.snapshot.ops import create, snapshot_metrics, store_for
    svc = load(policy_path)
    with guarded(svc, "snapshot create", wait_s, extra_dirs=((store_for(svc).root, "snapshot images dir"),)):
        svc, facts = snapshot_context(svc)
        _require_snapshot_prereqs(svc, facts)
        snap = create(svc, facts, leave_running=not stop_engine, progress=say)
        snapshot_metrics(svc)
    emit({"id": snap.id, "path": str(snap.path), **snap.manifest}, as_json,
         f"snapshot {snap.id} ({snap.manifest['image_bytes'] / 1e6:.1f} MB"
         + (", without the weights: restores through criu+ipc" if snap.manifest.get("kind") == "weightless" else "")
         + ") is current; engine " + ("stopped" if stop_engine else "still serving"))


@snapshot_group.command("restore")
@service_options(wait=True)
def snapshot_restore(policy_path, wait_s, as_json):
    """Restore the current snapshot as the engine: criu (criu+ipc for a weights-less one), with its recovery path.

    \b
    Examples:
      restartkit snapshot restore --policy llm.toml"""
    from restartkit.snapshot.ops import store_for
    cur = store_for(load(policy_path)).current()
    strategy = "criu+ipc" if cur is not None and cur.manifest.get("kind") == "weightless" else "criu"
    # strict: a restore that only a recovery (a cold start) served exits 3, not 0
    restart_and_exit(policy_path, strategy, as_json, "snapshot restore", wait_s, strict=True)


@snapshot_group.command("list")
@service_options()
def snapshot_list(policy_path, as_json):
    """Snapshots on disk, newest last; * marks current.

    \b
    Examples:
      restartkit snapshot list --policy llm.toml
      restartkit snapshot list --policy llm.toml --json"""
    from restartkit.snapshot.ops import store_for
    store = store_for(load(policy_path))
    cur = store.current()
    snaps = store.list()
    rows = [{"id": s.id, "kind": s.manifest.get("kind") or "full",
             "current": cur is not None and s.id == cur.id,
             "age_h": round(s.age_s / 3600, 2) if not s.damaged and not s.suspect else None,
             "image_bytes": s.manifest.get("image_bytes"), "suspect": s.suspect,
             "tested": (s.manifest.get("tested") or {}).get("ok"), "damaged": s.damaged} for s in snaps]
    text = "\n".join(f"{'*' if r['current'] else ' '} {r['id']}  {r['kind']:<10} {r['age_h'] if r['age_h'] is not None else '?':>6} h  "
                     f"{(r['image_bytes'] or 0) / 1e6:>8.1f} MB"
                     + {True: "  test-restored", False: "  test restore failed", None: ""}[r["tested"]]
                     + (f"  SUSPECT: {r['suspect']['reason']}" if r["suspect"] else "")
                     + (f"  DAMAGED (kept for inspection): {r['damaged']}" if r["damaged"] else "")
                     for r in rows) or "no snapshots"
    emit({"snapshots": rows, "dir": str(store.root)}, as_json, text)


def pick_snapshot(svc, snapshot_id: str | None):
    """(store, the snapshot named, or the current one); a usage error naming the store when there is none."""
    from restartkit.errors import UsageError
    from restartkit.snapshot.ops import store_for
    store = store_for(svc)
    snap = store.get(snapshot_id) if snapshot_id else store.current()
    if snap is None:
        raise UsageError(f"no snapshot {snapshot_id or '(current)'} in {store.root}", hint="restartkit snapshot list")
    if snap.damaged:
        raise UsageError(f"snapshot {snap.id} is damaged: {snap.damaged}", hint=f"it is kept for inspection in "
                         f"{snap.path}; take a new one with `restartkit snapshot create`, remove it when done")
    return store, snap


@snapshot_group.command("inspect")
@service_options()
@click.argument("snapshot_id", required=False)
def snapshot_inspect(policy_path, snapshot_id, as_json):
    """A snapshot's manifest, and how its identity compares with this host.

    \b
    Examples:
      restartkit snapshot inspect --policy llm.toml 20261204T020000Z"""
    from restartkit.snapshot.ops import host_identity, mismatches
    svc, facts = snapshot_context(policy_path)
    snap = pick_snapshot(svc, snapshot_id)[1]
    miss = mismatches(snap.manifest["identity"], host_identity(svc, facts))
    data = {"id": snap.id, "path": str(snap.path), "mismatches": miss, **snap.manifest}
    kind = snap.manifest.get("kind") or "full"
    emit(data, as_json, f"{snap.id} ({kind}{': restores through criu+ipc' if kind == 'weightless' else ''}): "
         f"{snap.manifest['image_bytes'] / 1e6:.1f} MB, {snap.age_s / 3600:.1f} h old, "
         + ("matches this host" if not miss else "does NOT match: " + "; ".join(miss))
         + (f"; SUSPECT: {snap.suspect['reason']}" if snap.suspect else ""))
