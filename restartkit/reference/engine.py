"""The reference engine's runtime: load, allocate, warm up, capture, generate.

Init phases are timed one by one (weight load, KV-cache allocation, warm-up,
CUDA-graph capture) so a restart's time can be taken apart afterwards.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from restartkit.reference.checkpoint import DTYPES, iter_checkpoint
from restartkit.reference.model import LlamaForCausalLM, ModelConfig


@dataclass
class EngineOptions:
    model: str
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on CPU, the checkpoint's dtype on CUDA
    max_model_len: int = 1024
    cuda_graph: bool = True
    seed: int = 0


@dataclass
class Completion:
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str


class EngineNotReady(RuntimeError):
    pass


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

    # ---- start-up ----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device(self.options.device)

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
        if self.device.type == "cuda":
            self._timed("cuda_init", torch.cuda.init)
        self.config = ModelConfig.load(self.options.model)
        self._timed("weight_load", weights or self.load_from_disk)
        self._timed("kv_cache_alloc", self.model.allocate_kv_cache, self.options.max_model_len)
        self._timed("warmup", self.warmup)
        if self.device.type == "cuda" and self.options.cuda_graph:
            self._timed("cuda_graph_capture", self.capture_decode_graph)

    def build_on_meta(self) -> LlamaForCausalLM:
        with torch.device("meta"):
            model = LlamaForCausalLM(self.config)
        return model.to(dtype=self.dtype)

    def load_from_disk(self) -> None:
        model = self.build_on_meta()
        params = dict(model.named_parameters())
        seen = set()
        for name, tensor in iter_checkpoint(self.options.model, device=str(self.device)):
            if name not in params:
                raise ValueError(f"checkpoint tensor {name} has no place in the model")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
            set_tensor(model, name, tensor.to(self.dtype))
            seen.add(name)
        missing = set(params) - seen
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
        self.model = model.eval()
        self.load_info = {"source": "disk", "tensors": len(seen)}

    @torch.inference_mode()
    def warmup(self) -> None:
        """A real forward pass: /health says ready only after this ran."""
        self._generate_locked([self.config.bos_token_id, 1, 2, 3], max_tokens=2, temperature=0.0, seed=0, want_logprobs=False)

    @torch.inference_mode()
    def capture_decode_graph(self) -> None:
        dev = self.device
        tok = torch.zeros(1, dtype=torch.long, device=dev)
        pos = torch.zeros(1, dtype=torch.long, device=dev)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(tok, pos)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.model(tok, pos)
        self._graph = graph
        self._static = {"tok": tok, "pos": pos, "out": out}

    def drop_graph(self) -> None:
        self._graph, self._static = None, {}

    # ---- generation -----------------------------------------------------------
    def generate(self, prompt: list[int], max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, want_logprobs: bool = False) -> Completion:
        with self.lock:
            return self._generate_locked(prompt, max_tokens, temperature, seed, want_logprobs)

    @torch.inference_mode()
    def _generate_locked(self, prompt, max_tokens, temperature, seed, want_logprobs) -> Completion:
        if self.model is None or self.model.cache_k is None:
            raise EngineNotReady("the engine holds no weights or KV cache")
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_tokens > self.model.max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds max_model_len ({self.model.max_len})")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        dev = self.device
        gen = torch.Generator().manual_seed(seed if seed is not None else self.options.seed)
        logits = self.model(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev))[-1]
        out, lps, finish = [], [] if want_logprobs else None, "length"
        pos = len(prompt)
        for step in range(max_tokens):
            logits32 = logits.float().cpu()
            if temperature and temperature > 0:
                probs = torch.softmax(logits32 / temperature, dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            else:
                nxt = int(torch.argmax(logits32))
            if lps is not None:
                lps.append(float(torch.log_softmax(logits32, dim=-1)[nxt]))
            out.append(nxt)
            if nxt == self.config.eos_token_id:
                finish = "stop"
                break
            if step + 1 < max_tokens:
                logits = self._decode(nxt, pos)
                pos += 1
        return Completion(list(prompt), out, lps, finish)

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
            freed = self.model.kv_cache_bytes
            self.drop_graph()
            self.model.drop_kv_cache()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return freed

    def restore_kv_cache(self) -> None:
        with self.lock:
            if self.model.cache_k is None:
                self.model.allocate_kv_cache(self.options.max_model_len)
                if self.device.type == "cuda" and self.options.cuda_graph:
                    self.capture_decode_graph()

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def set_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the parameter `name` (no copy)."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    setattr(mod, attr, torch.nn.Parameter(tensor, requires_grad=False))
