"""The reference engine's model runner: load, allocate, warm up, capture, and run the forward passes the
scheduler asks for (prefill, decode); the memory it holds (KV cache, weights) let go and taken back.
It knows nothing of sequences or requests: restartkit.reference.sched drives it.

Init phases are timed one by one (weight load, KV-cache allocation, warm-up,
CUDA-graph capture) so a restart's time can be taken apart afterwards.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from restartkit.reference.model import kernels, paged
from restartkit.reference.model.checkpoint import DTYPES
from restartkit.reference.model.llama import LlamaForCausalLM, ModelConfig, Parallel, UnsupportedConfig, check_parallel
from restartkit.reference.model.weights import build_model, processed_weights, set_tensor
from restartkit.reference.runtime.graphs import DecodeGraphs, Launch
from restartkit.reference.runtime.memory import device_memory, trim_heap
from restartkit.reference.runtime.piecewise import MixedGraphs, mixed_graphs


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
    max_num_seqs: int = 8  # KV-cache slots: the sequences that run at once (restartkit.reference.sched)
    kv_cache_memory: int = 0  # the KV cache's bytes (0: every slot at max_model_len, or gpu_memory_utilization's)
    gpu_memory_utilization: float = 0.0  # a GPU: the share of its memory the engine may hold, KV cache included


class EngineNotReady(RuntimeError):
    pass


# what rank 0 tells the other ranks to run (tensor parallel)
CMD_EXIT, CMD_PREFILL, CMD_DROP_KV, CMD_RESTORE_KV, CMD_DECODE, CMD_SPECULATE, CMD_MIXED, CMD_TABLE = range(8)
GRAPH_RESERVE = 1 << 30  # a GPU's memory left out of gpu_memory_utilization's KV cache: graphs, activations


@dataclass
class ModelRunner:
    options: EngineOptions
    config: ModelConfig = None
    model: LlamaForCausalLM = None
    phases: dict[str, float] = field(default_factory=dict)
    load_info: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _graphs: DecodeGraphs | None = None  # the decode step's CUDA graphs (one per batch size)
    _pieces: MixedGraphs | None = None  # a mixed step's graphs between its chunks' attention (captured as needed)
    is_draft: bool = False  # a draft model: one KV-cache slot, run by its model's speculative decoding
    draft: "ModelRunner | None" = None  # a draft model: greedy requests decode speculatively with it
    spec_tokens: int = 3  # draft tokens proposed per round
    spec_counts: dict = field(default_factory=lambda: {"rounds": 0, "proposed": 0, "accepted": 0})
    run_ahead: bool | None = None  # None: where decode graphs run (see runs_ahead)
    _last_greedy: Launch | None = None  # the last greedy step without graphs (a chained step's tokens)
    blocks: paged.Blocks | None = None  # who holds which KV-cache block, where the cache is paged
    kv_rows: int | None = None  # the KV cache's rows of blocks (None: one per slot, every slot at max_model_len)

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
            kernels.load_in_background()  # the decode step's Triton kernels, imported while the weights load
        self.config = ModelConfig.load(self.options.model)
        if self.config.rope_type == "dynamic" and self.options.max_model_len > self.config.max_position_embeddings:
            raise UnsupportedConfig(
                f"config.json rope_type 'dynamic' past max_position_embeddings ({self.config.max_position_embeddings}):"
                f" max_model_len {self.options.max_model_len} would need the rope recomputed per length, which the "
                "reference engine does not do; lower max_model_len to max_position_embeddings")
        if problem := check_parallel(self.config, self.par):
            raise ValueError(problem)
        self._check_memory(from_disk=weights is None)
        if self.options.tp_size > 1 and getattr(self, "_control", None) is None:  # a draft shares its model's
            self._timed("dist_init", self.init_distributed)
        self._weights = weights or self.load_from_disk
        if before_weights is not None:
            before_weights()
        self._timed("weight_load", self._weights)
        if self.options.tp_size > 1:
            self._gather_load_results()

    def _check_memory(self, from_disk: bool) -> None:
        """Refuse, before allocating anything, a model whose weights (when read from disk) and KV cache
        would not fit in this device's memory at all: a config.json with absurd sizes fails in seconds."""
        weights, cache = self.config.estimate_bytes(self.dtype.itemsize, self.slots, self.options.max_model_len,
                                                    self.options.tp_size)
        if self.options.kv_cache_memory or self.options.gpu_memory_utilization:
            cache = self.options.kv_cache_memory  # a budget: checked against it when the cache is sized
        need = cache + (weights if from_disk else 0)
        total = device_memory(self.device)
        if total and need > total:
            gib = 1 << 30
            raise UnsupportedConfig(
                f"config.json sizes need {need / gib:.1f} GiB on {self.device} (weights {weights / gib:.1f} GiB, "
                f"KV cache {cache / gib:.1f} GiB for {self.slots} sequences of {self.options.max_model_len} tokens); "
                f"it has {total / gib:.1f} GiB: check config.json's sizes, or lower max_model_len or max_num_seqs")

    def warm_up_early(self, max_len: int = 256) -> None:
        """Before activation, for an engine prepared beside the one it replaces: the first
        forward pass's one-time costs (kernel loading, library set-up) paid on a small
        temporary KV cache, so that activation is left with allocation and graph capture."""
        def run():
            self.model.allocate_kv_cache(min(max_len, self.options.max_model_len), 1)
            try:
                self.warmup(1)
            finally:
                self.model.drop_kv_cache()
        self._timed("early_warmup", run)

    def activate(self) -> None:
        """What needs the device to itself: KV cache, warm-up, graph capture."""
        self.kv_rows = self._kv_rows()
        self._timed("kv_cache_alloc", self._allocate_kv)
        graph = self.device.type == "cuda" and self.options.cuda_graph and self.options.tp_size == 1
        # the capture runs the decode step eagerly first: the warm-up then needs only the prefill
        self._timed("warmup", self.warmup, 1 if graph else 2)
        if graph:
            self._timed("cuda_graph_capture", self.capture_decode_graph)

    def _kv_rows(self) -> int | None:
        """The KV cache's rows of blocks (a row: one sequence at max_model_len and a block more) from its budget
        (kv_cache_memory, or gpu_memory_utilization of the GPU less what is held already); None: a row per slot
        (restartkit.reference.model.paged)."""
        o, cfg = self.options, self.config
        if self.is_draft or not (o.kv_cache_memory or (o.gpu_memory_utilization and self.device.type == "cuda")):
            return None
        if o.kv_cache_memory:
            budget, said = o.kv_cache_memory, f"--kv-cache-memory {o.kv_cache_memory}"
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * o.gpu_memory_utilization) - (total - free) - GRAPH_RESERVE
            said = f"--gpu-memory-utilization {o.gpu_memory_utilization} ({max(budget, 0) >> 20} MiB left for it)"
        return paged.rows_for(budget, said, cfg, o.tp_size, self.dtype.itemsize, o.max_model_len, self.slots)

    @property
    def kv_blocks(self) -> int | None:
        """The KV cache's blocks, the spare one included (None: no cache)."""
        return None if self.model is None or self.model.kv is None else self.model.kv.blocks

    def _allocate_kv(self) -> None:
        self.model.allocate_kv_cache(self.options.max_model_len, self.slots, self.kv_rows)
        self.blocks = None if self.model.kv.static else paged.Blocks(self.model.kv)

    def reserve(self, slot: int, upto: int) -> bool:
        """KV-cache blocks for positions [0, upto) of the sequence in `slot`; False when too few are free (the
        scheduler then preempts).  Where every slot has its own blocks, nothing to do."""
        got = [] if self.blocks is None else self.blocks.reserve(slot, upto)
        if got:
            self._set_blocks(slot, len(self.blocks.held[slot]) - len(got), got)
        return got is not None

    def release(self, slot: int) -> None:
        """The blocks of the sequence in `slot` back (it left, or was preempted)."""
        if self.blocks is not None and (n := self.blocks.release(slot)):
            self._set_blocks(slot, 0, [0] * n)  # a write at a position it no longer holds lands in scratch

    def free_blocks(self) -> int | None:
        """KV-cache blocks no sequence holds; None where every slot has its own."""
        return None if self.blocks is None else self.blocks.available

    def _set_blocks(self, slot: int, col: int, ids: list[int]) -> None:
        if self.leads:
            self._broadcast(CMD_TABLE, [slot, col], ids)
        self.model.kv.set(slot, col, ids)

    @property
    def slots(self) -> int:
        """KV-cache slots: max_num_seqs, or one for a draft model (it runs one sequence at a time)."""
        return 1 if self.is_draft else self.options.max_num_seqs

    @property
    def leads(self) -> bool:
        """Rank 0 of a tensor-parallel group, serving: it tells the other ranks each step it runs.  Before it
        serves (the warm-up) every rank runs the same steps by itself, in lockstep."""
        return self.options.tp_size > 1 and self.options.tp_rank == 0 and self.serving

    @property
    def serving(self) -> bool:
        """Whether a scheduler drives this runner (restartkit.reference.sched.engine says)."""
        return False

    def can_serve(self) -> bool:
        return self.model is not None and self.model.cache_k is not None

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
        """A real forward pass, prefill then greedy decode steps in slot 0: /health says ready only after this ran."""
        tokens = [self.config.bos_token_id, 1, 2, 3]
        self.reserve(0, len(tokens) + max_tokens)
        token = int(self.prefill(0, tokens, 0)[-1].argmax())
        for position in range(len(tokens), len(tokens) + max_tokens - 1):
            token = self.decode_greedy([0], [token], [position])[0]
        self.release(0)

    def capture_decode_graph(self) -> None:
        pieces = mixed_graphs(self.model, self.device)  # nothing captured yet: each step size when first run
        # where a mixed step is one graph, a prompt prefilled alone is a mixed step of one chunk (`prefill`): every
        # prompt row attends by one kernel, so no prefill graph is kept; the smallest such step is captured here,
        # as the prefill graphs were, so that a restart's first short request finds it
        whole = pieces is not None and pieces.whole
        self._graphs = DecodeGraphs(self.model, self.device, prefills=not whole)
        self._pieces = pieces
        if whole:  # at a start or a KV cache's restore: no sequence holds slot 0
            tokens = [self.config.bos_token_id, 1, 2, 3]
            self.reserve(0, len(tokens))
            with torch.inference_mode():
                for _ in range(2):  # the first run is eager and captures it, the second replays it
                    pieces.run([(0, 0, tokens)])
            self.release(0)

    def drop_graph(self) -> None:
        self._graphs = self._pieces = None

    # ---- the steps the scheduler runs ----------------------------------------------------------
    def check_prompt(self, prompt, max_tokens) -> None:
        if not self.can_serve():
            raise EngineNotReady("the engine holds no weights or KV cache")
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_tokens > self.model.max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds max_model_len ({self.model.max_len})")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        """Prompt tokens start.. of the sequence in `slot` into its KV cache; their logits [T, vocab] (from a
        prefill graph: the last token's only, [1, vocab])."""
        if self.leads:
            self._broadcast(CMD_PREFILL, [slot, start], tokens)
        if self._pieces is not None and self._pieces.whole and (
                logits := self._pieces.run([(slot, start, tokens)])) is not None:  # the last token's logits only
            return logits  # every prompt row by the kernel a mixed step's chunks attend by (capture_decode_graph)
        if self._graphs is not None and self._graphs.prefills(len(tokens)):  # the last token's logits only
            return self._graphs.prefill(slot, tokens, start)
        dev = self.device
        return self.model(torch.tensor(tokens, device=dev), torch.arange(start, start + len(tokens)).to(dev), slot,
                          start + len(tokens))

    def graphed_prefill(self, tokens: int) -> bool:
        """Whether a prompt chunk of this many tokens runs as a prefill graph."""
        return self._graphs is not None and self._graphs.prefills(tokens)

    @torch.inference_mode()
    def mixed(self, segments: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """Decode rows and prompt chunks in one forward pass (segments: slot, first position, tokens), as graph pieces
        where they are (runtime.piecewise), else eagerly: each segment's last logits [S, vocab], until the next step."""
        if self.leads:  # slots, first positions, lengths, then every token
            slots, starts, toks = zip(*segments)
            self._broadcast(CMD_MIXED, [len(segments)],
                            [*slots, *starts, *map(len, toks), *(x for t in toks for x in t)])
        if self._pieces is not None and (logits := self._pieces.run(segments)) is not None:
            return logits
        tokens = torch.tensor([x for _, _, t in segments for x in t], device=self.device)
        return self.model.mixed(tokens, [(slot, p0, len(t)) for slot, p0, t in segments])

    def decode_greedy(self, slots: list[int], tokens: list[int], positions: list[int]) -> list[int]:
        """`decode`, each row's likeliest token only."""
        return self.launch_greedy(slots, tokens, positions).tokens(slots)

    @property
    def runs_ahead(self) -> bool:
        """Whether the scheduler may launch a greedy step before it has read the last one's tokens: with decode
        graphs (their launch does not wait), or where `run_ahead` asks for it (one rank only)."""
        return self.options.tp_size == 1 and (self._graphs is not None if self.run_ahead is None else self.run_ahead)

    @torch.inference_mode()
    def launch_greedy(self, slots: list[int], tokens: list[int] | None, positions: list[int],
                      chained: bool = False) -> Launch:
        """Start a decode step whose rows' likeliest tokens are read from the returned Launch (the argmax where
        the logits are: one integer per row crosses to the host).  `chained` (one rank only): each slot's token
        is the one its last launched step chose, still on the device; `tokens` is unused."""
        if self._graphs is not None:  # one rank only (graphs are captured at tp_size 1)
            return self._graphs.launch(slots, tokens, positions, chained)[1]
        if chained:
            last = self._last_greedy  # the last step's choices, row by row in the order of its slots
            where = {s: i for i, s in enumerate(last.slots)}
            tok = last.values.index_select(0, torch.tensor([where[s] for s in slots], device=last.values.device))
            values = self._eager_decode(tok, slots, positions).argmax(dim=-1)
        else:
            values = self.decode(slots, tokens, positions).argmax(dim=-1)
        self._last_greedy = Launch(values, list(slots), by_slot=False)
        return self._last_greedy

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token of each sequence (row b: `tokens[b]` at `positions[b]` in slot `slots[b]`) in one
        forward pass; their logits [B, vocab].  With decode graphs: the smallest graph that holds the
        highest slot (restartkit.reference.runtime.graphs)."""
        if self.leads:
            self._broadcast(CMD_DECODE, [len(slots)], [*slots, *tokens, *positions])
        if self._graphs is not None:
            return self._graphs.run(slots, tokens, positions)
        return self._eager_decode(torch.tensor(tokens, device=self.device), slots, positions)

    def _eager_decode(self, tokens: torch.Tensor, slots: list[int], positions: list[int]) -> torch.Tensor:
        """`decode` without a graph, the tokens already on the device; attends up to the batch's last position."""
        dev = self.device
        pos = torch.tensor(positions, device=dev)
        if slots == list(range(len(slots))):  # the first B slots in order: read in place where in their home blocks
            return self.model.decode(tokens, pos, None, span=max(positions) + 1)
        return self.model.decode(tokens, pos, torch.tensor(slots, device=dev), span=max(positions) + 1)

    # ---- tensor parallel: rank 0 tells the others what to run -------------------
    def _broadcast(self, cmd: int, args=(), payload=()) -> None:
        """A command, up to four integer arguments and a list of integers, from rank 0 to every rank."""
        import torch.distributed as dist
        header = torch.tensor([cmd, len(payload), *args, *[0] * (4 - len(args))], dtype=torch.long)
        group = getattr(self, "_control", None)
        dist.broadcast(header, src=0, group=group)
        if len(payload):
            dist.broadcast(torch.tensor(payload, dtype=torch.long), src=0, group=group)

    # ---- memory -------------------------------------------------------------
    def drop_kv_cache(self) -> int:
        """Free the KV cache and cached allocator blocks, on every rank; returns bytes freed.  The caller holds
        the engine (restartkit.reference.sched.scheduler.Scheduler.exclusive)."""
        if self.options.tp_size > 1:
            self._broadcast(CMD_DROP_KV)
        freed = self._drop_kv_locked()
        trim_heap()
        return freed

    def _drop_kv_locked(self) -> int:
        freed = self.model.kv_cache_bytes
        self.drop_graph()
        self.model.drop_kv_cache()
        self.blocks = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def restore_kv_cache(self) -> None:
        """The KV cache (and decode graphs) back, on every rank; the caller holds the engine."""
        if self.options.tp_size > 1:
            self._broadcast(CMD_RESTORE_KV)
        self._restore_kv_locked()

    def _restore_kv_locked(self) -> None:
        if self.model.cache_k is None:
            self._allocate_kv()
            if self.device.type == "cuda" and self.options.cuda_graph and self.options.tp_size == 1:
                self.capture_decode_graph()

    # ---- weights released before a weights-less snapshot, re-attached after ---------------
    def release_weights(self) -> dict:
        """Let go of the weights this engine maps from the weight cache (and of its KV cache):
        no tensor, mapping or handle of the arena is left in this process, so a snapshot of it
        holds neither.  Only for weights that came from the weight cache: they can come back.  The caller holds
        the engine."""
        import gc
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
        trim_heap()  # freed host memory back to the kernel: CRIU dumps every page still mapped
        return {"weights_released_bytes": nbytes, "kv_cache_freed_bytes": freed_kv}

    def reattach_weights(self, fallback: bool = False) -> dict:
        """Map the weights from the weight cache again (after a restore, in the restored process),
        then the KV cache and the decode graph; returns how the weights came (load_info).  The caller holds the
        engine."""
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

