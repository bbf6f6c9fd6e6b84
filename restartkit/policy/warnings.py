"""What a policy asks for that its own other keys rule out, said before anything is tried
(`policy check`, `preload`): each warning names the strategy that will never be eligible, why,
and the key to change.  The policy and the engine adapter are read (the engine as installed here,
for what its build has); what else the host lacks (root, CRIU, a free GPU) is `plan`'s to say."""
from __future__ import annotations


def asked_for(policy) -> set[str]:
    """The strategies the policy means to use: named in [restart] strategies, or, with auto, those
    its sections turn on ([ipc] and [criu] written, [sleep] and [standby] enabled)."""
    named = set(policy.strategies) - {"auto"}
    if "auto" in policy.strategies:
        if "ipc" in policy.written:
            named |= {"ipc", "criu+ipc"} if "criu" in policy.written else {"ipc"}
        if "criu" in policy.written:
            named.add("criu")
        if policy.sleep["enabled"]:
            named.add("sleep")
        if policy.standby["enabled"]:
            named.add("standby")
    return named


def warnings(policy) -> list[str]:
    from restartkit.engines import get_adapter
    svc, asked = policy.service, asked_for(policy)
    adapter, _problem = get_adapter(svc["engine"])
    features = adapter.feature_problems(policy) if adapter is not None else {}
    sleepy = policy.sleep["enabled"] or "--enable-sleep-mode" in svc["engine_args"]
    out = []

    def never(strategy: str, why: str, fix: str) -> None:
        out.append(f"{strategy} is never eligible with this policy: {why}; {fix}")

    for s in ("ipc", "sleep"):
        if s in asked and features.get(s):
            out.append(f"{s} is never eligible with this policy on this host: {features[s]}; run it where the "
                       f"engine has it, or remove [{s}] / choose another [service] engine")
    if "ipc" in asked and sleepy and policy.ipc["mode"] == "zero_copy" and not features.get("ipc"):
        never("ipc", "sleep mode parks weights the engine owns, and [ipc] mode = \"zero_copy\" (the default) maps them "
              "from the weight cache", "set [ipc] mode = \"copy\", or [sleep] enabled = false")
    if "ipc" in asked and svc["pipeline_parallel_size"] != 1:
        never("ipc", f"pipeline_parallel_size = {svc['pipeline_parallel_size']} is not supported by the weight cache",
              "set [service] pipeline_parallel_size = 1")
    if "standby" in asked:
        if svc["engine"] not in ("reference", "vllm"):
            never("standby", f"the {svc['engine']} adapter has no prepare-only mode to hold a standby in",
                  "set [standby] enabled = false")
        elif svc["engine"] == "reference" and policy.ipc["mode"] != "zero_copy":
            never("standby", "a standby maps its weights from the weight cache, and [ipc] mode is "
                  f"{policy.ipc['mode']!r}", "set [ipc] mode = \"zero_copy\", or [standby] enabled = false")
        elif svc["engine"] == "vllm" and policy.ipc["health_port"]:
            never("standby", "a standby vLLM loads from restartkit's weight cache, and [ipc] health_port names vLLM's "
                  "own (`vllm preload`)", "set [ipc] health_port = 0, or [standby] enabled = false")
        elif sleepy:
            out.append("sleep is not eligible once a standby serves: the standby maps its weights zero_copy from the "
                       "weight cache, which sleep mode cannot park; choose [standby] or [sleep]")
    for s in ("criu", "criu+ipc"):
        sizes = {k: svc[k] for k in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size") if svc[k] != 1}
        if s in asked and sizes:
            never(s, "CRIU snapshots need one process on one device; the policy sets "
                  + ", ".join(f"{k} = {v}" for k, v in sizes.items()), "remove [criu], or run the service at TP1")
    if policy.restart["overlap"] and adapter is not None and (problem := adapter.overlap_problem(policy)):
        out.append(f"[restart] overlap = true does nothing with this policy: {problem}; set it to false")
    return out


def host_warnings(policy) -> list[str]:
    """What this host lacks for a strategy the policy asks for, where the restart would go on without it
    (to the next strategy, and in the end cold): CRIU for the criu strategies."""
    from restartkit.facts import find_criu
    wants = sorted(s for s in asked_for(policy) if s.startswith("criu"))
    if not wants:
        return []
    path, why = find_criu(policy.criu["criu_path"])
    if path:
        return []
    return [f"{', '.join(wants)} cannot run on this host: CRIU {why}; install it (scripts/install-criu, CRIU 4 or "
            f"later) or set [criu] criu_path in {policy.path}; `restartkit plan` says what else it needs"]
