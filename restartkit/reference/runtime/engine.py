"""The reference engine's runtime: load, allocate, warm up, capture, generate.

Init phases are timed one by one (weight load, KV-cache allocation, warm-up,
CUDA-graph capture) so a restart's time can be taken apart afterwards.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from restartkit.reference.model.checkpoint import DTYPES
from restartkit.reference.model.llama import LlamaForCausalLM, ModelConfig, Parallel, UnsupportedConfig, check_parallel
from restartkit.reference.model.weights import build_model, processed_weights


@dataclass
class EngineOptions:
    model: str
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on CPU, the checkpoint's dtype on CUDA
    max_model_len: int = 1024
    cuda_graph: bool = True
    seed: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    expert_parallel: bool = False
    quantization: str = "none"
    dist_init: str = ""  # tcp://host:port of rank 0, for tp_size > 1


@dataclass
class Completion:
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str
    top_logprobs: list[dict[int, float]] | None = None  # per token: the k likeliest ids and their logprobs


# called with each new token id as it is chosen, with its logprob and top logprobs when asked (else None);
# True: stop here (a stop string was met)
OnToken = Callable[[int, float | None, dict | None], bool] | None


class EngineNotReady(RuntimeError):
    pass


CMD_EXIT, CMD_GENERATE, CMD_DROP_KV, CMD_RESTORE_KV = 0, 1, 2, 3


def _note_logprobs(logits32: torch.Tensor, chosen: int, lps: list | None, tops: list | None, k: int) -> None:
    if lps is None and tops is None:
        return
    logp = torch.log_softmax(logits32, dim=-1)
    if lps is not None:
        lps.append(float(logp[chosen]))
    if tops is not None:
        vals, ids = torch.topk(logp, min(k, logp.shape[-1]))
        tops.append({int(i): float(v) for i, v in zip(ids, vals)})


def _last(lps: list | None, tops: list | None) -> tuple:
    """The logprob and top logprobs just noted, for on_token (None where not asked)."""
    return (lps[-1] if lps else None), (tops[-1] if tops else None)


@dataclass
class Engine:
    options: EngineOptions
    config: ModelConfig = None
    model: LlamaForCausalLM = None
    phases: dict[str, float] = field(default_factory=dict)
    load_info: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _graph: object = None
    _static: dict = field(default_factory=dict)
    draft: "Engine | None" = None  # a draft model: greedy requests decode speculatively with it
    spec_tokens: int = 3  # draft tokens proposed per round
    spec_counts: dict = field(default_factory=lambda: {"rounds": 0, "proposed": 0, "accepted": 0})

    # ---- start-up ----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        if self.options.device == "cuda":  # always indexed: rank r runs on GPU r
            return torch.device("cuda", self.options.tp_rank)
        return torch.device(self.options.device)

    @property
    def par(self) -> Parallel:
        o = self.options
        return Parallel(tp_size=o.tp_size, tp_rank=o.tp_rank, expert_parallel=o.expert_parallel)

    @property
    def dtype(self) -> torch.dtype:
        if self.options.dtype:
            return DTYPES[self.options.dtype]
        return torch.float32 if self.device.type == "cpu" else DTYPES[self.config.torch_dtype]

    def _timed(self, phase: str, fn, *args):
        t0 = time.perf_counter()
        result = fn(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.phases[phase] = round(time.perf_counter() - t0, 4)
        return result

    def start(self, weights=None) -> None:
        """Build the model and bring it to ready.  `weights`, when given, is
        a callable that fills the meta-device model (the ipc loader)."""
        self.prepare(weights)
        self.activate()

    def prepare(self, weights=None, before_weights=None) -> None:
        """Everything that can happen while another engine still serves:
        device context, configuration, process group, weights.
        `before_weights`, when given, runs just before the weights load."""
        if self.device.type == "cuda":
            self._timed("cuda_init", lambda: torch.cuda.set_device(self.device))
        self.config = ModelConfig.load(self.options.model)
        if self.config.rope_type == "dynamic" and self.options.max_model_len > self.config.max_position_embeddings:
            raise UnsupportedConfig(
                f"config.json rope_type 'dynamic' past max_position_embeddings ({self.config.max_position_embeddings}):"
                f" max_model_len {self.options.max_model_len} would need the rope recomputed per length, which the "
                "reference engine does not do; lower max_model_len to max_position_embeddings")
        if problem := check_parallel(self.config, self.par):
            raise ValueError(problem)
        if self.options.tp_size > 1 and getattr(self, "_control", None) is None:  # a draft shares its model's
            self._timed("dist_init", self.init_distributed)
        self._weights = weights or self.load_from_disk
        if before_weights is not None:
            before_weights()
        self._timed("weight_load", self._weights)
        if self.options.tp_size > 1:
            self._gather_load_results()

    def warm_up_early(self, max_len: int = 256) -> None:
        """Before activation, for an engine prepared beside the one it replaces: the first
        forward pass's one-time costs (kernel loading, library set-up) paid on a small
        temporary KV cache, so that activation is left with allocation and graph capture."""
        def run():
            self.model.allocate_kv_cache(min(max_len, self.options.max_model_len))
            try:
                self.warmup(1)
            finally:
                self.model.drop_kv_cache()
        self._timed("early_warmup", run)

    def activate(self) -> None:
        """What needs the device to itself: KV cache, warm-up, graph capture."""
        self._timed("kv_cache_alloc", self.model.allocate_kv_cache, self.options.max_model_len)
        graph = self.device.type == "cuda" and self.options.cuda_graph and self.options.tp_size == 1
        # the capture runs the decode step eagerly first: the warm-up then needs only the prefill
        self._timed("warmup", self.warmup, 1 if graph else 2)
        if graph:
            self._timed("cuda_graph_capture", self.capture_decode_graph)

    def init_distributed(self) -> None:
        import datetime

        import torch.distributed as dist
        o = self.options
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=o.dist_init, world_size=o.tp_size, rank=o.tp_rank,
                                timeout=datetime.timedelta(seconds=300))
        # Requests travel on a CPU group whatever the device.  Workers wait on
        # it while idle, so it never times out; a dead rank 0 takes them down
        # through their parent-death signal instead.
        self._control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))

    def reload_weights(self) -> None:
        """Load the weights again from where they came from at start (disk or weight cache)."""
        self._weights()

    def _gather_load_results(self) -> None:
        """Every rank's weight source, so rank 0 can say hit, fallback or mixed."""
        import torch.distributed as dist
        codes = {"hit": 1, "fallback": 2}
        mine = torch.tensor([codes.get(self.load_info.get("ipc"), 0)], dtype=torch.long)
        every = [torch.zeros(1, dtype=torch.long) for _ in range(self.options.tp_size)]
        dist.all_gather(every, mine, group=self._control)
        names = {1: "hit", 2: "fallback", 0: "disk"}
        self.load_info["ranks"] = [names[int(t)] for t in every]

    def build_on_meta(self) -> LlamaForCausalLM:
        return build_model(self.config, self.par, self.dtype, self.options.quantization)

    def load_from_disk(self) -> None:
        o = self.options
        self.install(processed_weights(o.model, self.config, self.par, self.dtype, o.quantization, str(self.device)),
                     {"source": "disk"})

    def install(self, named_tensors, info: dict) -> None:
        """Place processed tensors into a meta-built model; every parameter must be filled."""
        model = self.build_on_meta()
        params = dict(model.named_parameters())
        seen = set()
        tied = self.config.tie_word_embeddings
        for name, tensor in named_tensors:
            if tied and name == "lm_head.weight":
                continue  # tied: the output projection is the embedding, as transformers loads it
            if name not in params:
                raise ValueError(f"tensor {name} has no place in the model")
            if tuple(tensor.shape) != tuple(params[name].shape) or tensor.dtype != params[name].dtype:
                raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the model wants "
                                 f"{tuple(params[name].shape)} {params[name].dtype}")
            set_tensor(model, name, tensor)
            seen.add(name)
        if tied and "model.embed_tokens.weight" in seen:
            model.tie()
            seen.add("lm_head.weight")
        missing = set(params) - seen
        if missing:
            raise ValueError(f"{len(missing)} tensors are missing, e.g. {sorted(missing)[0]}")
        self.model = model.eval()
        self.load_info = {**info, "tensors": len(seen)}

    @torch.inference_mode()
    def warmup(self, max_tokens: int = 2) -> None:
        """A real forward pass: /health says ready only after this ran."""
        self._generate_locked([self.config.bos_token_id, 1, 2, 3], max_tokens=max_tokens, temperature=0.0, seed=0,
                              want_logprobs=False)

    def capture_decode_graph(self) -> None:
        self._graph, self._static = capture_decode(self.model, self.device)

    def drop_graph(self) -> None:
        self._graph, self._static = None, {}

    # ---- generation -----------------------------------------------------------
    def generate(self, prompt: list[int], max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, want_logprobs: bool = False, top_logprobs: int = 0,
                 on_token: OnToken = None) -> Completion:
        """`top_logprobs`: the k likeliest tokens at each step too; `on_token`: each token as it is chosen
        (streaming, stop strings).  With tensor parallelism every rank runs the same steps, so a stop asked
        by `on_token` ends the completion's tokens but not its steps (the caller cuts the text)."""
        with self.lock:
            self._validate(prompt, max_tokens)
            if self.options.tp_size > 1:
                self._broadcast(CMD_GENERATE, prompt, max_tokens, temperature, seed, want_logprobs)
            return self._generate_locked(prompt, max_tokens, temperature, seed, want_logprobs, top_logprobs, on_token)

    # ---- tensor parallel: rank 0 tells the others what to run -------------------
    def _broadcast(self, cmd: int, prompt=(), max_tokens=0, temperature=0.0, seed=None, want_logprobs=False):
        import struct

        import torch.distributed as dist
        temp_bits = struct.unpack("<q", struct.pack("<d", float(temperature)))[0]
        header = torch.tensor([cmd, len(prompt), max_tokens, temp_bits, -1 if seed is None else seed, int(want_logprobs)],
                              dtype=torch.long)
        group = getattr(self, "_control", None)
        dist.broadcast(header, src=0, group=group)
        if len(prompt):
            dist.broadcast(torch.tensor(prompt, dtype=torch.long), src=0, group=group)

    def worker_loop(self) -> None:
        """Ranks > 0: run what rank 0 broadcasts, until told to exit."""
        import struct

        import torch.distributed as dist
        group = getattr(self, "_control", None)
        while True:
            header = torch.zeros(6, dtype=torch.long)
            dist.broadcast(header, src=0, group=group)
            cmd, n, max_tokens, temp_bits, seed, want_lp = header.tolist()
            if cmd == CMD_EXIT:
                return
            if cmd == CMD_GENERATE:
                prompt = torch.zeros(n, dtype=torch.long)
                dist.broadcast(prompt, src=0, group=group)
                temperature = struct.unpack("<d", struct.pack("<q", temp_bits))[0]
                self._generate_locked(prompt.tolist(), max_tokens, temperature, None if seed < 0 else seed, bool(want_lp))
            elif cmd == CMD_DROP_KV:
                self._drop_kv_locked()
            elif cmd == CMD_RESTORE_KV:
                self._restore_kv_locked()

    def shutdown_workers(self) -> None:
        if self.options.tp_size > 1 and self.options.tp_rank == 0:
            with self.lock:
                self._broadcast(CMD_EXIT)

    def _validate(self, prompt, max_tokens) -> None:
        if self.model is None or self.model.cache_k is None:
            raise EngineNotReady("the engine holds no weights or KV cache")
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_tokens > self.model.max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds max_model_len ({self.model.max_len})")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")

    @torch.inference_mode()
    def _generate_locked(self, prompt, max_tokens, temperature, seed, want_logprobs, top_logprobs=0,
                         on_token: OnToken = None) -> Completion:
        if self.draft is not None and not (temperature and temperature > 0):
            return self._speculate_locked(prompt, max_tokens, want_logprobs, top_logprobs, on_token)
        dev, eos = self.device, self.config.eos_token_ids
        gen = torch.Generator().manual_seed(seed if seed is not None else self.options.seed)
        logits = self.model(torch.tensor(prompt, device=dev), torch.arange(len(prompt)).to(dev))[-1]
        out, lps, tops = [], [] if want_logprobs else None, [] if top_logprobs else None
        finish, stopped, lockstep = "length", False, self.options.tp_size > 1
        pos = len(prompt)
        for step in range(max_tokens):
            logits32 = logits.float().cpu()
            if temperature and temperature > 0:
                probs = torch.softmax(logits32 / temperature, dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            else:
                nxt = int(torch.argmax(logits32))
            if not stopped:
                _note_logprobs(logits32, nxt, lps, tops, top_logprobs)
                out.append(nxt)
            if nxt in eos:  # every rank ends here, as every rank chose the same token
                finish = "stop"
                break
            if not stopped and on_token is not None and on_token(nxt, *_last(lps, tops)):
                finish, stopped = "stop", True
                if not lockstep:  # the other ranks take the steps to the end: so does this one, silently
                    break
            if step + 1 < max_tokens:
                logits = self._decode(nxt, pos)
                pos += 1
        return Completion(list(prompt), out, lps, finish, tops)

    @torch.inference_mode()
    def _speculate_locked(self, prompt, max_tokens, want_logprobs, top_logprobs=0, on_token: OnToken = None) -> Completion:
        """Greedy decoding with the draft proposing up to spec_tokens tokens a round, which this
        model checks in one forward pass: every token emitted is this model's own greedy choice
        (the draft only decides how many come out of one pass)."""
        dev, draft, eos = self.device, self.draft, self.config.eos_token_ids
        seq, out, lps, tops = list(prompt), [], [] if want_logprobs else None, [] if top_logprobs else None
        stop = []

        def take(row: torch.Tensor) -> int:  # this model's greedy choice from one row of logits
            row32 = row.float().cpu()
            nxt = int(torch.argmax(row32))
            _note_logprobs(row32, nxt, lps, tops, top_logprobs)
            out.append(nxt)
            seq.append(nxt)
            if on_token is not None and nxt not in eos and on_token(nxt, *_last(lps, tops)):
                stop.append(True)
            return nxt

        def done() -> bool:
            return len(out) >= max_tokens or out[-1] in eos or bool(stop)

        take(self.model(torch.tensor(prompt, device=dev), torch.arange(len(prompt)).to(dev))[-1])
        drafted = 0  # how much of seq the draft's KV cache holds
        while not done():
            pos = len(seq) - 1  # the last token's position: in neither cache yet
            k = min(self.spec_tokens, max_tokens - len(out))
            # the draft catches up on what it has not seen (through the last token), then proposes k
            logits = draft.model(torch.tensor(seq[drafted:], device=dev), torch.arange(drafted, pos + 1).to(dev))[-1]
            props = [int(torch.argmax(logits))]
            for j in range(1, k):
                logits = draft.model(torch.tensor([props[-1]], device=dev), torch.tensor([pos + j], device=dev))[0]
                props.append(int(torch.argmax(logits)))
            # row j: this model's logits after the last token and the first j proposals
            rows = self.model(torch.tensor([seq[-1], *props], device=dev), torch.arange(pos, pos + k + 1).to(dev))
            j = 0  # proposals accepted
            while take(rows[j]) == (props[j] if j < k else None):
                j += 1
                if done():
                    break
            drafted = pos + 1 + min(j, k - 1)  # the proposals it was fed and that were kept
            self.spec_counts["rounds"] += 1
            self.spec_counts["proposed"] += k
            self.spec_counts["accepted"] += j
        return Completion(list(prompt), out, lps, "stop" if out[-1] in eos or stop else "length", tops)

    def _decode(self, token: int, pos: int) -> torch.Tensor:
        if self._graph is not None:
            self._static["tok"].fill_(token)
            self._static["pos"].fill_(pos)
            self._graph.replay()
            return self._static["out"][0]
        dev = self.device
        return self.model(torch.tensor([token], device=dev), torch.tensor([pos], device=dev))[0]

    # ---- memory -------------------------------------------------------------
    def drop_kv_cache(self) -> int:
        """Free the KV cache and cached allocator blocks; returns bytes freed."""
        with self.lock:
            if self.options.tp_size > 1:
                self._broadcast(CMD_DROP_KV)
            freed = self._drop_kv_locked()
            _trim_heap()
            return freed

    def _drop_kv_locked(self) -> int:
        freed = self.model.kv_cache_bytes
        self.drop_graph()
        self.model.drop_kv_cache()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def restore_kv_cache(self) -> None:
        with self.lock:
            if self.options.tp_size > 1:
                self._broadcast(CMD_RESTORE_KV)
            self._restore_kv_locked()

    def _restore_kv_locked(self) -> None:
        if self.model.cache_k is None:
            self.model.allocate_kv_cache(self.options.max_model_len)
            if self.device.type == "cuda" and self.options.cuda_graph and self.options.tp_size == 1:
                self.capture_decode_graph()

    # ---- weights released before a weights-less snapshot, re-attached after ---------------
    def release_weights(self) -> dict:
        """Let go of the weights this engine maps from the weight cache (and of its KV cache):
        no tensor, mapping or handle of the arena is left in this process, so a snapshot of it
        holds neither.  Only for weights that came from the weight cache: they can come back."""
        import gc
        with self.lock:
            if self.options.tp_size > 1 or self.draft is not None:
                raise ValueError("weights are released at tensor_parallel_size 1 without a draft model only")
            if self.model is None:
                return {"weights_released_bytes": 0, "kv_cache_freed_bytes": 0, "already": True}
            if self.load_info.get("source") != "ipc":
                raise ValueError(f"the weights came from {self.load_info.get('source')}, not the weight cache: "
                                 "there is nothing to re-attach them from")
            freed_kv = self._drop_kv_locked()
            nbytes = self.weight_bytes()
            self.model = None
            mapping, self._ipc_mapping = getattr(self, "_ipc_mapping", None), None
            gc.collect()
            if mapping is not None:
                mapping.close()  # the memfd arena (CPU): unmapped; its fd was closed at attach
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.ipc_collect()  # the CUDA IPC handle: closed once no storage holds it
            _trim_heap()  # freed host memory back to the kernel: CRIU dumps every page still mapped
            return {"weights_released_bytes": nbytes, "kv_cache_freed_bytes": freed_kv}

    def reattach_weights(self, fallback: bool = False) -> dict:
        """Map the weights from the weight cache again (after a restore, in the restored process),
        then the KV cache and the decode graph; returns how the weights came (load_info)."""
        with self.lock:
            if self.model is None:
                t0 = time.perf_counter()
                self._weights(fallback=fallback)
                self.load_info["reattach_s"] = round(time.perf_counter() - t0, 4)
            self._restore_kv_locked()
            return dict(self.load_info)

    def weight_bytes(self) -> int:
        if self.model is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.device.type != "meta")


def _trim_heap() -> None:
    """glibc's malloc_trim: free heap pages returned to the kernel (elsewhere: nothing)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@torch.inference_mode()
def capture_decode(model, dev: torch.device):
    """A CUDA graph of one decode step (token and position as static inputs), after two
    eager runs on a side stream; returns (graph, {"tok", "pos", "out"})."""
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(tok, pos)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(tok, pos)
    return graph, {"tok": tok, "pos": pos, "out": out}


def set_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the parameter `name` (no copy)."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    setattr(mod, attr, torch.nn.Parameter(tensor, requires_grad=False))
