"""The reference engine's command line: parsed here, and rebuilt for its tensor-parallel workers."""
from __future__ import annotations

import argparse
import json
import os


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0..65535)")
    return port


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not at least 1")
    return n


def _size(text: str) -> int:
    """Bytes: a number, or one with K, M, G or T (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        n = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2G, 512M or a number of bytes)") from None
    if not 0 < n < 1 << 60:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size above 0")
    return int(n)


def _share(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"{x} is not a share of the GPU's memory in (0, 1]")
    return x


DESCRIPTION = "Serve a checkpoint with the reference engine (OpenAI routes)."
EXAMPLES = """examples:
  restartkit engine serve --model ./m --port 8000
  restartkit engine serve --model ./m --device cuda --dtype bfloat16 --max-num-seqs 32 --enable-sleep-mode"""


def _bounds(p: argparse.ArgumentParser) -> None:
    """How much the engine takes on at once: sequences decoded, sequences waiting, client connections."""
    p.add_argument("--max-num-seqs", type=_positive, default=None,
                   help="sequences decoded at once (default 8; with a KV-cache budget below, 64 on the CPU and 256 on "
                        "a GPU, as many as its blocks hold)")
    p.add_argument("--kv-cache-memory", type=_size, default=0,
                   help="the KV cache's size (e.g. 2G): sequences take 64-token blocks of it as they grow, and the "
                        "newest is preempted (and recomputed later) when none is free; default: every sequence's "
                        "max-model-len at once")
    p.add_argument("--gpu-memory-utilization", type=_share, default=0.0,
                   help="a GPU: the share of its memory the engine may hold; the KV cache is what the weights and "
                        "1 GiB for graphs leave of it (as --kv-cache-memory)")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=None,
                   help="tokens one step runs: a decode row per running sequence and, in the same forward pass, "
                        "chunks of joining prompts up to it (a running stream waits one such step at most while a "
                        "long prompt joins); at least --max-num-seqs (default 2048 on a GPU, 512 on the CPU)")
    p.add_argument("--max-queued-seqs", type=_positive, default=256,
                   help="sequences waiting for a slot; a request that would queue more gets a 503 with Retry-After")
    p.add_argument("--max-connections", type=_positive, default=1024,
                   help="client connections answered at once; one that has sent nothing yet holds no thread")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="restartkit engine serve", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=_positive, default=1024)
    _bounds(p)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--run-ahead", default="auto", choices=["auto", "on", "off"],
                   help="launch a greedy batch's next decode step before this one's tokens are read (auto: where "
                        "CUDA graphs run; on: on the CPU too, where it hides nothing; off: never)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=os.environ.get("RESTARTKIT_API_KEY") or None,
                   help="clients must send it (Authorization: Bearer) to /v1/*, /tokenize and /detokenize; "
                        "default: $RESTARTKIT_API_KEY (the environment keeps it out of the process list)"),
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-rank", type=int, default=0)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--quantization", default="none", choices=["none", "int8"])
    p.add_argument("--revision", default="")
    p.add_argument("--load-format", default="disk", choices=["disk", "ipc_cache"])
    p.add_argument("--ipc-config", default="{}", help="JSON: mode, fallback, connect_timeout_s, state_timeout_s, socket_dir")
    p.add_argument("--dist-port", type=int, default=0, help="rank 0's rendezvous port (tensor parallel)")
    p.add_argument("--worker-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--gate-fds", default="", help=argparse.SUPPRESS)  # a prepared worker's pipes to and from rank 0
    p.add_argument("--listen-fd", type=int, default=None,
                   help="serve on this listening socket (inherited; its supervisor holds it) instead of binding "
                        "--host/--port; accepted on once ready.  LISTEN_FDS (socket activation) works the same")
    p.add_argument("--reuse-port", action="store_true", help="SO_REUSEPORT on the public port (overlapped restarts)")
    p.add_argument("--prepare-only", action="store_true",
                   help="prepare (imports, device, weights), then wait for SIGUSR1 before taking the device and the port")
    p.add_argument("--status-file", default=None, help="JSON state for the supervisor (prepare-only mode)")
    p.add_argument("--activate-timeout", type=float, default=300.0)
    p.add_argument("--activate-ahead", action="store_true",
                   help="prepare-only mode: activate (KV cache, warm-up, graph) at once, and wait for SIGUSR2 only")
    p.add_argument("--enable-sleep-mode", action="store_true", help="POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping")
    p.add_argument("--sleep-endpoints-public", action="store_true", help="answer sleep endpoints off loopback too")
    p.add_argument("--draft-model", default="", help="a draft checkpoint: greedy requests decode speculatively")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="draft tokens proposed per round")
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What no single flag's type says: combinations, and the IPC config's JSON."""
    if args.max_num_batched_tokens is None:  # on an H100 at 8B shapes and 64 clients 2048 gave 2,425 out tok/s
        # and 512 2,220 (docs/BENCHMARKS.md); on the CPU a step of 2048 prompt tokens stalls the running streams
        args.max_num_batched_tokens = 2048 if args.device.startswith("cuda") else 512
    if args.max_num_seqs is None:
        budget = args.kv_cache_memory or (args.gpu_memory_utilization and args.device.startswith("cuda"))
        args.max_num_seqs = (256 if args.device.startswith("cuda") else 64) if budget else 8
        args.max_num_seqs = min(args.max_num_seqs, args.max_num_batched_tokens)
    if args.max_num_batched_tokens < args.max_num_seqs:
        p.error(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) is less than --max-num-seqs "
                f"({args.max_num_seqs}): every running sequence decodes a token each step; raise it to at least "
                f"{args.max_num_seqs}")
    if args.draft_model:
        if args.enable_sleep_mode:
            p.error("--draft-model cannot be combined with --enable-sleep-mode")
        if args.num_speculative_tokens < 1:
            p.error("--num-speculative-tokens must be at least 1")
    try:
        args.ipc = json.loads(args.ipc_config)
        if not isinstance(args.ipc, dict):
            raise ValueError("not an object")
    except ValueError as e:
        p.error(f"--ipc-config is not a JSON object: {e}")


def _rebuild_argv(args) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs),
           "--tensor-parallel-size", str(args.tensor_parallel_size), "--quantization", args.quantization,
           "--data-parallel-size", str(args.data_parallel_size), "--data-parallel-rank", str(args.data_parallel_rank),
           "--load-format", args.load_format, "--ipc-config", json.dumps(args.ipc), "--dist-port", str(args.dist_port),
           "--threads", str(args.threads), "--revision", args.revision]
    if args.dtype:
        out += ["--dtype", args.dtype]
    if args.kv_cache_memory:
        out += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.gpu_memory_utilization:
        out += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.enable_expert_parallel:
        out.append("--enable-expert-parallel")
    if args.no_cuda_graph:
        out.append("--no-cuda-graph")
    if args.draft_model:
        out += ["--draft-model", args.draft_model, "--num-speculative-tokens", str(args.num_speculative_tokens)]
    return out
