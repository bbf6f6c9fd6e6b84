"""Questions to the daemons of a service (used by plan, the ipc strategy and the CLI)."""
from __future__ import annotations

from restartkit.weightcache import protocol
from restartkit.weightcache.fingerprint import CHECKPOINT
from restartkit.weightcache.launcher import Layout, expected_uuids


def layout_from_policy(policy) -> Layout:
    s, i = policy.service, policy.ipc
    if s["engine"] == "vllm":  # vLLM's load format takes the checkpoint's tensors and processes them itself
        dtype = CHECKPOINT
    else:
        dtype = s["dtype"] if s["dtype"] != "auto" else ("float32" if s["device"] == "cpu" else _checkpoint_dtype(s["model"]))
    return Layout(model=s["model"], device=s["device"], tp_size=s["tensor_parallel_size"], dp_size=s["data_parallel_size"],
                  dp_start_rank=i["data_parallel_start_rank"], expert_parallel=s["expert_parallel"], nnodes=i["nnodes"],
                  node_rank=i["node_rank"], master_addr=i["master_addr"],
                  weight_cache_master_port=i["weight_cache_master_port"], engine_master_port=i["engine_master_port"],
                  dtype=dtype, quantization=s["quantization"], revision=s["revision"], socket_dir=i["socket_dir"],
                  draft_model=s["draft_model"])


def _checkpoint_dtype(model: str) -> str:
    import json
    from pathlib import Path
    try:
        return json.loads((Path(model) / "config.json").read_text()).get("torch_dtype", "bfloat16")
    except (OSError, ValueError):
        return "bfloat16"


def daemon_stats(policy) -> list[dict]:
    """One entry per local rank of the engine and group (the model's ranks, then the draft
    model's): its daemon's stats, or why there are none."""
    lay = layout_from_policy(policy)
    out = []
    for _, draft in lay.groups():
        # the engine's ranks: DP rank 0 of this service (one replica per policy)
        for uuid in expected_uuids(lay)[: lay.tp_size]:
            path = protocol.socket_path(uuid, draft, lay.socket_dir)
            where = {"device_uuid": uuid, "socket": str(path), "draft": draft}
            try:
                reply, fds = protocol.request(path, {"op": "stats"}, timeout=5.0,
                                              connect_timeout=policy.ipc["connect_timeout_s"])
                protocol._close(fds)
                out.append({**where, **reply})
            except FileNotFoundError:
                out.append({**where, "state": "absent"})
            except (ConnectionError, OSError, TimeoutError, protocol.ProtocolError) as e:
                out.append({**where, "state": "unreachable", "error": str(e)})
    return out


def send_all(policy, op: str, force: bool = False) -> list[dict]:
    lay = layout_from_policy(policy)
    out = []
    for _, draft in lay.groups():
        for uuid in expected_uuids(lay):
            path = protocol.socket_path(uuid, draft, lay.socket_dir)
            try:
                reply, fds = protocol.request(path, {"op": op, "force": force}, timeout=10.0)
                protocol._close(fds)
                out.append({"device_uuid": uuid, "draft": draft, **reply})
            except (OSError, TimeoutError, protocol.ProtocolError) as e:
                out.append({"device_uuid": uuid, "draft": draft, "ok": False, "error": str(e)})
    return out
