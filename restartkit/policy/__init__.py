"""Policy files: one TOML file per service.

The schema is data (SCHEMA below): each key's type, default and allowed
values.  `load_policy` reads and checks the whole file before anything is
touched; an error names the file, the key, the bad value and what is allowed.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from restartkit.engines import ENGINE_NAMES
from restartkit.errors import PolicyError, PolicyErrors
from restartkit.policy.checks import (_argv, _calendar, _canary, _env, _fraction, _host, _hours, _name,
                                      _non_negative, _parallel, _path, _port, _port_or_zero, _positive, _revision,
                                      _seconds, _served_name, _strategy_list, show)
from restartkit.weightcache.loader import DEFAULTS as LOADER

DEFAULT_STATE_ROOT = "~/.local/state/restartkit"


@dataclass(frozen=True)
class Key:
    type: type | tuple
    default: Any
    allowed: tuple | None = None
    doc: str = ""
    check: Any = None  # callable(value) -> problem or None


SCHEMA: dict[str, dict[str, Key]] = {
    "service": {
        "name": Key(str, None, doc="service name; names the state directory", check=_name),
        "engine": Key(str, "reference", ENGINE_NAMES, "engine adapter"),
        "model": Key(str, None, doc="checkpoint directory (or hub id for vllm/sglang); ~ and $VARS are expanded",
                     check=_path),
        "revision": Key(str, "", doc="pinned 40-hex revision", check=_revision),
        "served_model_name": Key(str, "", check=_served_name, doc="the model name the engine serves and restartkit's probes and canary "
                                               "send (default: the adapter's own, else the first of /v1/models)"),
        "host": Key(str, "127.0.0.1", check=_host),
        "port": Key(int, 8000, check=_port),
        "device": Key(str, "cpu", ("cpu", "cuda")),
        "dtype": Key(str, "auto", ("auto", "float32", "bfloat16", "float16")),
        "tensor_parallel_size": Key(int, 1, check=_parallel(64, "the devices one model instance spans")),
        "data_parallel_size": Key(int, 1, check=_parallel(1024, "replicas")),
        "pipeline_parallel_size": Key(int, 1, check=_parallel(64, "pipeline stages")),
        "expert_parallel": Key(bool, False),
        "quantization": Key(str, "none", ("none", "int8"), "weight-only quantization applied at load (processed weights)"),
        "max_model_len": Key(int, 1024, check=_positive),
        "draft_model": Key(str, "", doc="a draft checkpoint (reference engine): greedy requests decode "
                                         "speculatively with it, and the weight cache serves it in its own group",
                           check=_path),
        "num_speculative_tokens": Key(int, 3, check=_positive, doc="draft tokens proposed per round"),
        "engine_args": Key(list, [], doc="extra command-line arguments for the engine", check=_argv),
        "env": Key(dict, {}, doc="extra environment for the engine (string values)", check=_env),
        "api_key_file": Key(str, "", check=_path,
                            doc="a file holding the API key clients must send (Authorization: Bearer): given to the "
                                "engine in its environment, sent by restartkit's probes and canary, never written to "
                                "a record or a log"),
        "command": Key(list, [], doc="argv of the engine (engine = 'command' only)", check=_argv),
        "state_dir": Key(str, "", doc="default: --state-dir ($RESTARTKIT_STATE_DIR) or ~/.local/state/restartkit", check=_path),
    },
    "restart": {
        "strategies": Key(list, ["auto"], doc="'auto' or strategies in preference order", check=_strategy_list),
        "rank": Key(str, "measured", ("measured", "order"),
                    doc="with strategies = ['auto']: measured ranks the eligible strategies by this service's "
                        "measured (or estimated) time, fastest first; order keeps sleep > criu+ipc > ipc > criu > cold"),
        "rank_runs": Key(int, 5, check=_positive, doc="the last N successful restarts of a strategy whose median counts"),
        "rank_max_age_h": Key((int, float), 168.0, check=_hours,
                              doc="measurements older than this do not count"),
        "rank_failures": Key(int, 2, check=_positive,
                             doc="a strategy whose last N restarts in a row ended in recovery is ranked last"),
        "rank_cooldown_s": Key((int, float), 3600.0, check=_seconds,
                               doc="... until this long after its last failure, then it is tried first again"),
        "start_timeout_s": Key((int, float), 300.0, check=_seconds),
        "stop_timeout_s": Key((int, float), 30.0, check=_seconds),
        "canary_prompts": Key(list, ["The quick brown fox", "Restarting an inference server"], check=_canary),
        "canary_max_tokens": Key(int, 16, check=_positive),
        "overlap": Key(bool, False, doc="ipc restarts prepare the new engine while the old one serves (reference engine)"),
        "overlap_mode": Key(str, "auto", ("auto", "serve_beside", "prestart"),
                            doc="serve_beside: the new engine serves beside the old one before it stops (room for "
                                "a second KV cache); prestart: the new engine is prepared beside the old one "
                                "(process, imports, device, weights mapped) and activated once it stopped (one KV "
                                "cache); auto: serve_beside when free memory holds a second KV cache, else prestart"),
    },
    "ipc": {
        # the engine-side loader's keys (restartkit.weightcache.loader.LOADER_KEYS), with its defaults
        "mode": Key(str, LOADER["mode"], ("zero_copy", "copy")),
        "fallback": Key(bool, LOADER["fallback"]),
        "connect_timeout_s": Key((int, float), LOADER["connect_timeout_s"], check=_seconds),
        "state_timeout_s": Key((int, float), LOADER["state_timeout_s"], check=_seconds),
        "socket_dir": Key(str, LOADER["socket_dir"], doc="default: $TMPDIR/restartkit-wc-<uid>", check=_path),
        "health_host": Key(str, "127.0.0.1", check=_host),
        "health_port": Key(int, 0, doc="0: no health endpoint", check=_port_or_zero),
        "startup_timeout_s": Key((int, float), 900.0, check=_seconds),
        "data_parallel_start_rank": Key(int, 0, check=_non_negative),
        "nnodes": Key(int, 1, check=_positive),
        "node_rank": Key(int, 0, check=_non_negative),
        "master_addr": Key(str, "127.0.0.1", check=_host),
        "weight_cache_master_port": Key(int, 29650, check=_port),
        "engine_master_port": Key(int, 29500, check=_port),
    },
    "criu": {
        "images_dir": Key(str, "", doc="default: <state dir>/snapshots", check=_path),
        "keep": Key(int, 2, check=_positive),
        "max_age_h": Key((int, float), 24.0, check=_hours),
        "refresh": Key(str, "daily", doc="systemd OnCalendar= expression for the refresh timer", check=_calendar),
        "criu_path": Key(str, "", check=_path),
        "refuse_secrets": Key(bool, False, doc="snapshot create refuses (instead of warning) when the engine's "
                                               "environment or arguments carry a key, token or password"),
        "test_restore": Key(bool, False, doc="refresh makes a new snapshot current only after a test restore beside the engine passed (restartkit snapshot test; CPU snapshots)"),
        "pid_wait_s": Key((int, float), 10.0, check=_seconds),
        "restore_timeout_s": Key((int, float), 600.0, check=_seconds),
        "weights": Key(str, "auto", ("auto", "include", "exclude"),
                       doc="auto: an engine that maps its weights from the weight cache is snapshotted without them "
                           "(restored by criu+ipc, re-attached from the cache), any other with them; include: always "
                           "with them (refused for an engine on the weight cache); exclude: always without them"),
    },
    "supervise": {
        "health_interval_s": Key((int, float), 5.0, check=_seconds, doc="how often /health is asked"),
        "health_timeout_s": Key((int, float), 3.0, check=_seconds),
        "health_misses": Key(int, 3, check=_positive, doc="misses in a row that make the engine hung"),
        "completion_interval_s": Key((int, float), 30.0, check=_seconds,
                                     doc="how often a real completion (the canary's first prompt) is asked"),
        "completion_timeout_s": Key((int, float), 30.0, check=_seconds),
        "start_limit_interval_s": Key((int, float), 600.0, check=_seconds, doc="as systemd's StartLimitIntervalSec"),
        "start_limit_burst": Key(int, 5, check=_positive,
                                 doc="more failures than this within the interval: give up, engine left stopped, exit 1"),
        "backoff_s": Key((int, float), 1.0, check=_seconds, doc="pause before the second failure's restart, doubling"),
        "backoff_max_s": Key((int, float), 30.0, check=_seconds),
        "min_uptime_s": Key((int, float), 5.0, check=_seconds,
                            doc="an engine that served this long before it died did not fail to start: its crash is "
                                "recovered at once and counts neither for the backoff nor for start_limit_burst "
                                "(supervisord's startsecs)"),
    },
    "standby": {
        "enabled": Key(bool, False, doc="keep a standby engine armed (prepared on the weight cache, not listening): "
                       "supervise arms it and promotes it on a crash; the standby strategy promotes it on a restart"),
        "kv_ahead": Key(str, "auto", ("auto", "always", "never"),
                        doc="the standby allocates its KV cache and captures its graph while it waits (promotion is "
                            "then the port only): auto on a GPU whose free memory holds twice the running "
                            "engine's KV cache"),
        "promote_timeout_s": Key((int, float), 30.0, check=_seconds,
                                 doc="how long a promotion may take before the restart falls to its recovery"),
    },
    "metrics": {
        "textfile_dir": Key(str, "", check=_path, doc="where the Prometheus textfiles go: the node exporter's "
                            "--collector.textfile.directory, shared by the services of a host (files "
                            "restartkit_<service>*.prom, mode 0644); default: the state dir (metrics.prom, "
                            "snapshot.prom)"),
    },
    "front": {
        "enabled": Key(bool, True,
                       doc="under supervise, the front (restartkit.front) answers clients on [service] host and "
                           "port, and continues a request in flight on the next engine when its engine dies; the "
                           "engines serve behind it on 127.0.0.1:[front] engine_port. false: the engines take "
                           "[service] port themselves, and a crash fails the requests in flight"),
        "engine_port": Key(int, 0, check=_port_or_zero,
                           doc="the loopback port the engines serve on behind the front; 0: [service] port + 10000 "
                               "([service] port - 10000 above 55535)"),
        "wait_s": Key((int, float), 60.0, check=_seconds,
                      doc="how long a request waits in the front for an engine before a 503 with Retry-After"),
        "max_in_flight": Key(int, 4096, check=_positive, doc="requests the front holds at once; past it, a 503"),
    },
    "sleep": {
        "enabled": Key(bool, False, doc="start the engine with sleep mode (needed by the sleep strategy)"),
        "level": Key(int, 1, (1, 2)),
        "min_freed_fraction": Key((int, float), 0.5, check=_fraction,
                                  doc="sleep must free at least this share of weights + KV cache, or it failed"),
    },
}


# What the keys above without a doc of their own mean (docs/policy.md is generated from the schema: scripts/policydoc.py).
MEANINGS = {
    ("service", "host"): "address the engine serves on (0.0.0.0: every interface; plan warns beyond loopback)",
    ("service", "port"): "TCP port the service answers on",
    ("service", "device"): "where the engine computes",
    ("service", "dtype"): "the weights' type in the engine (auto: the checkpoint's)",
    ("service", "tensor_parallel_size"): "devices one model instance is split over (TP)",
    ("service", "data_parallel_size"): "model replicas (DP), one weight-cache group each",
    ("service", "pipeline_parallel_size"): "pipeline stages (PP): CRIU needs 1",
    ("service", "expert_parallel"): "experts spread over the data-parallel ranks (EP)",
    ("service", "max_model_len"): "longest sequence (prompt and answer) the engine takes",
    ("restart", "start_timeout_s"): "how long a start may take before it failed",
    ("restart", "stop_timeout_s"): "how long a stop waits after SIGTERM before SIGKILL",
    ("restart", "canary_prompts"): "the fixed prompts whose greedy tokens must be identical before and after a restart",
    ("restart", "canary_max_tokens"): "tokens generated for each canary prompt",
    ("ipc", "mode"): "zero_copy: the engine maps the cache's memory; copy: it copies it (then it may sleep)",
    ("ipc", "fallback"): "load from disk when the cache cannot serve (counted as a fallback), else fail",
    ("ipc", "connect_timeout_s"): "how long the engine waits to reach its weight-cache daemon",
    ("ipc", "state_timeout_s"): "how long the engine waits for the daemon to hold the weights",
    ("ipc", "health_host"): "address of the weight cache's health endpoint",
    ("ipc", "startup_timeout_s"): "how long `preload` waits for every local rank to hold the weights",
    ("ipc", "data_parallel_start_rank"): "the first data-parallel rank on this node",
    ("ipc", "nnodes"): "nodes the service spans (one launcher per node)",
    ("ipc", "node_rank"): "this node's rank among them",
    ("ipc", "master_addr"): "the address the nodes' weight caches and engines meet at",
    ("ipc", "weight_cache_master_port"): "the port the weight caches of several ranks meet at",
    ("ipc", "engine_master_port"): "the port the engine's ranks meet at (torch.distributed)",
    ("criu", "keep"): "snapshots kept on disk (older ones pruned; suspect and damaged ones are kept)",
    ("criu", "max_age_h"): "a snapshot older than this is stale: refresh takes a new one",
    ("criu", "criu_path"): "the CRIU binary (default: /opt/restartkit/criu, then PATH)",
    ("criu", "pid_wait_s"): "how long a restore waits for the snapshot's PIDs to be free",
    ("criu", "restore_timeout_s"): "how long a restore may take before it is killed and the recovery runs",
    ("supervise", "health_timeout_s"): "how long one /health may take",
    ("supervise", "completion_timeout_s"): "how long the periodic real completion may take",
    ("supervise", "backoff_max_s"): "the longest pause between failed starts",
    ("sleep", "level"): "1: weights parked in host memory; 2: weights dropped and read again at wake",
}
for (_section, _key), _doc in MEANINGS.items():
    SCHEMA[_section][_key] = Key(**{**SCHEMA[_section][_key].__dict__, "doc": _doc})

# Keys that used to live elsewhere: the error says where they are now.
MOVED = {"ipc": {"draft_model": "write it as [service] draft_model: the engine decodes with it, and the weight "
                                "cache serves it in its own group"}}


def _typename(t) -> str:
    if isinstance(t, tuple):
        return "a number"
    return {str: "a string", int: "an integer", bool: "a boolean (true or false)", list: "a list",
            dict: "a table", float: "a number"}[t]


@dataclass
class Policy:
    path: str
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    state_root: str = ""  # where service state dirs live unless [service] state_dir says (the CLI's --state-dir)
    written: frozenset = frozenset()  # the sections the file itself has (the others are all defaults)
    public: tuple[str, int] | None = None  # behind supervise's front: the address clients use (behind_front)

    def __getattr__(self, name):  # policy.service, policy.restart, ...
        if name.startswith("__") or name in ("sections", "state_root", "written", "public"):
            raise AttributeError(name)
        try:
            return _Section(self.sections[name])
        except KeyError:
            raise AttributeError(name) from None

    @property
    def name(self) -> str:
        return self.sections["service"]["name"]

    @property
    def strategies(self) -> list[str]:
        return list(self.sections["restart"]["strategies"])

    def state_dir(self) -> Path:
        base = self.sections["service"]["state_dir"] or self.state_root or DEFAULT_STATE_ROOT
        return Path(os.path.expandvars(os.path.expanduser(base))) / self.name

    def to_dict(self) -> dict:
        return {"path": self.path, **self.sections}

    def engine_port_behind_front(self) -> int:
        port = self.sections["service"]["port"]
        return self.sections["front"]["engine_port"] or (port + 10000 if port <= 55535 else port - 10000)

    def behind_front(self) -> "Policy":
        """This policy as restartkit sees its engines behind supervise's front: [service] host 127.0.0.1 and
        port [front] engine_port (what every engine binds, what the canary and probes ask), the address clients
        use kept as `public` (the front's)."""
        if self.public is not None:
            return self
        svc = self.sections["service"]
        sections = {**self.sections, "service": {**svc, "host": "127.0.0.1", "port": self.engine_port_behind_front()}}
        return replace(self, sections=sections, public=(svc["host"], svc["port"]))


class _Section(dict):
    __getattr__ = dict.__getitem__


def expand(value: str) -> str:
    return os.path.expandvars(os.path.expanduser(value))


def parse_policy(data: dict, path: str = "<policy>") -> Policy:
    """Check `data` against SCHEMA; fill defaults.  Pure: no I/O.  Every problem of the file is
    named at once (PolicyErrors); the checks across keys run once each key is right."""
    errors: list[PolicyError] = [PolicyError(path, sec, "is not a section", f"sections are: {', '.join(SCHEMA)}")
                                 for sec in sorted(set(data) - set(SCHEMA))]
    sections: dict[str, dict] = {}
    for sec, keys in SCHEMA.items():
        raw = data.get(sec, {})
        if not isinstance(raw, dict):
            errors.append(PolicyError(path, sec, "must be a table", f"write it as [{sec}]"))
            raw = {}
        sections[sec] = _section(path, sec, raw, keys, errors)
    if errors:
        raise errors[0] if len(errors) == 1 else PolicyErrors(path, errors)
    policy = _across(path, sections)
    policy.written = frozenset(sec for sec in SCHEMA if isinstance(data.get(sec), dict))
    return policy


def _section(path: str, sec: str, raw: dict, keys: dict[str, Key], errors: list) -> dict:
    for k in sorted(set(raw) & set(MOVED.get(sec, {}))):
        errors.append(PolicyError(path, f"{sec}.{k}", "has moved", MOVED[sec][k]))
    for k in sorted(set(raw) - set(keys) - set(MOVED.get(sec, {}))):
        errors.append(PolicyError(path, f"{sec}.{k}", "is not a known key", f"keys of [{sec}] are: {', '.join(keys)}"))
    out = {}
    for k, spec in keys.items():
        where = f"{sec}.{k}"
        if k not in raw:
            if spec.default is None:
                errors.append(PolicyError(path, where, "is required", spec.doc or None))
            out[k] = spec.default
            continue
        v = raw[k]
        types = spec.type if isinstance(spec.type, tuple) else (spec.type,)
        # bool is an int in Python; a policy that says `port = true` is wrong.
        if isinstance(v, bool) and bool not in types or not isinstance(v, types):
            errors.append(PolicyError(path, where, f"is {show(v)} ({type(v).__name__})", f"must be {_typename(spec.type)}"))
        elif spec.allowed is not None and v not in spec.allowed:
            errors.append(PolicyError(path, where, f"is {show(v)}", f"allowed: {', '.join(map(str, spec.allowed))}"))
        elif spec.check is not None and (problem := spec.check(v)):
            errors.append(PolicyError(path, where, f"is {show(v)}: {problem}", spec.doc or None))
        else:
            out[k] = float(v) if spec.type == (int, float) else v
            continue
        out[k] = spec.default
    return out


def _across(path: str, sections: dict[str, dict]) -> Policy:
    svc = sections["service"]
    if svc["engine"] == "command" and not svc["command"]:
        raise PolicyError(path, "service.command", "is required when engine = 'command'", "give the engine's argv as a list")
    r = sections["restart"]
    longest = max((len(p.encode()) for p in r["canary_prompts"]), default=0) + 1  # bytes bound tokens; + BOS
    if r["canary_max_tokens"] + longest > svc["max_model_len"]:
        raise PolicyError(path, "restart.canary_max_tokens",
                          f"is {r['canary_max_tokens']}: with the longest canary prompt (up to {longest} tokens) it "
                          f"does not fit in [service] max_model_len ({svc['max_model_len']})",
                          f"lower it below {max(1, svc['max_model_len'] - longest)}, or raise max_model_len")
    ipc = sections["ipc"]
    if ipc["node_rank"] >= ipc["nnodes"]:
        raise PolicyError(path, "ipc.node_rank", f"is {ipc['node_rank']}: must be below [ipc] nnodes ({ipc['nnodes']})")
    if sections["front"]["engine_port"] == svc["port"]:
        raise PolicyError(path, "front.engine_port", f"is {svc['port']}, [service] port: the front answers there",
                          "give the engines behind the front another port, or 0 for [service] port + 10000")
    svc["model"] = expand(svc["model"]) if svc["engine"] == "reference" else svc["model"]
    if svc["draft_model"]:
        if svc["engine"] != "reference":
            raise PolicyError(path, "service.draft_model", f"is for the reference engine, not {svc['engine']!r}",
                              "give the engine its own speculative-decoding arguments in engine_args")
        if sections["sleep"]["enabled"]:
            raise PolicyError(path, "service.draft_model", "cannot be combined with [sleep] enabled",
                              "sleep parks the model's weights only: drop one of them")
        svc["draft_model"] = expand(svc["draft_model"])
    return Policy(path=path, sections=sections)


def load_policy(path: str | os.PathLike, state_root: str = "") -> Policy:
    """`state_root`: the default root of state dirs (a policy's [service] state_dir wins)."""
    p = Path(path)
    if not p.is_file():
        raise PolicyError(p, "", "no such policy file", "give the path of a TOML policy; examples are in policies/")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(p, "", f"is not valid TOML: {show(str(e), 200)}", "fix the syntax at the line and column named") from None
    except UnicodeDecodeError:
        raise PolicyError(p, "", "is not UTF-8 text", None) from None
    except RecursionError:
        raise PolicyError(p, "", "nests arrays or tables too deeply to read", "a policy needs two levels at most") from None
    except OSError as e:
        raise PolicyError(p, "", f"cannot be read: {e.strerror}", None) from None
    policy = parse_policy(data, str(p))
    policy.state_root = state_root or ""
    return policy
