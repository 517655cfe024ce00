"""Will the run fit in this machine's memory? An estimate of each process's peak, from the recipe's sizes.

`estimate_rl(cfg, model)` gives the peak resident memory (host, and GPU where a process runs on one) of the processes
`rl` starts for an RL config — the launcher, inference, orchestrator, trainer — from the model's shape (read from its
config.json and safetensors headers, without loading it) and the run's sizes:

    trainer      float32 master weights, gradients and AdamW's two moments (16 bytes a parameter), a bfloat16 copy of
                 the weights for a bfloat16 backward, the activations of one micro-batch (seq_len tokens through every
                 layer), the log-prob head's logits for one chunk of tokens, and the free space the heap keeps between
                 steps (`primerl.cpu.trim_freed_memory` hands it back above 1 GiB)
    inference    the weights in the serving dtype, twice on a CPU (oneDNN's pre-laid-out copy beside them) plus a new
                 version while it is loaded (its tensors and the file's pages), and the KV cache of max_batch_size
                 sequences of max_model_len tokens
    orchestrator what it imports, and its tokenizer (about 1 KB a vocabulary entry)
    launcher     what it imports (a preloading launcher holds torch and transformers)

Each sum starts from what the process's imports cost (`BASE_MB`, measured on x86-64 Linux with torch 2.13). The
launcher's and the orchestrator's figures and the inference server's weight copies were fitted to the peaks that
`benchmarks/memory_fit.py` measured for the tiny and the demo recipe; its third configuration checks them
(benchmarks/results/memory_fit.json).
The checklist's `memory_fit` step prints the estimate beside the machine's MemAvailable and refuses in one line when
the processes together will not fit.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primerl.cpu import cpu_has_bf16_dot_products

MB = 2**20
# Resident memory of each process before its model (imports, interpreter, server loop), measured (see above): as
# forks of a preloading launcher (rl.preload on a CPU-only run), whose pages they share and touch only in part, and
# as fresh interpreters (a GPU run, or the checklist's micro-step: 871 MB measured for the trainer).
BASE_MB = {"launcher": 300.0, "inference": 520.0, "orchestrator": 280.0, "trainer": 520.0}
FRESH_MB = {"inference": 870.0, "trainer": 870.0}
PRELOADED_LAUNCHER_MB = 860.0  # a preloading launcher (rl.preload) has imported torch, transformers and more
TOKENIZER_BYTES_PER_TOKEN = 1024  # the orchestrator's tokenizer and its per-token tables
HEAP_KEPT_BYTES = 2**30  # free heap a CPU trainer keeps between steps at most (primerl.cpu.TRIM_ABOVE_BYTES)
# Float32 values a decoder layer keeps per token for backward, in units of the hidden size and of the MLP's width.
ACTIVATION_HIDDEN, ACTIVATION_MLP = 8, 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its parameters and the sizes of its layers."""

    params: int
    hidden: int
    layers: int
    mlp: int
    vocab: int
    kv_heads: int
    head_dim: int

    @classmethod
    def read(cls, path: Path) -> ModelShape:
        """From a model directory: config.json and the safetensors files' headers (no tensor is loaded)."""
        config = json.loads((path / "config.json").read_text())
        config = config.get("text_config", config)
        params = sum(_safetensors_params(f) for f in sorted(path.glob("*.safetensors")))
        heads = config.get("num_attention_heads", 1)
        hidden = config["hidden_size"]
        return cls(params=params, hidden=hidden, layers=config["num_hidden_layers"],
                   mlp=config.get("intermediate_size", 4 * hidden), vocab=config["vocab_size"],
                   kv_heads=config.get("num_key_value_heads", heads),
                   head_dim=config.get("head_dim") or hidden // heads)


def _safetensors_params(path: Path) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            count = 1
            for size in entry["shape"]:
                count *= size
            total += count
    return total


@dataclass
class ProcessNeed:
    """One process's estimated peak: resident host memory and, on a GPU, device memory (bytes), with its parts."""

    role: str
    host_bytes: float
    gpu_bytes: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"role": self.role, "host_gib": round(self.host_bytes / 2**30, 3),
                "gpu_gib": round(self.gpu_bytes / 2**30, 3),
                "parts_mb": {k: round(v / MB, 1) for k, v in self.parts.items()}}


def trainer_need(model: ModelShape, seq_len: int, micro_batch_rows: int, on_gpu: bool, backward_bf16: bool,
                 chunk_tokens: int, activation_checkpointing: bool = False, forked: bool = False) -> ProcessNeed:
    base = (BASE_MB if forked else FRESH_MB)["trainer"] * MB
    p = model.params
    tokens = seq_len * micro_batch_rows
    per_token = (ACTIVATION_HIDDEN * model.hidden + ACTIVATION_MLP * model.mlp) * 4
    layers = 1 if activation_checkpointing else model.layers
    head_tokens = min(tokens, chunk_tokens)
    parts = {
        "weights, gradients, AdamW (16 B/param)": 16.0 * p,
        "bfloat16 weight copy": 2.0 * p if backward_bf16 else 0.0,
        "activations": float(tokens * per_token * layers + (model.layers * tokens * model.hidden * 4
                                                             if activation_checkpointing else 0)),
        "log-prob head": 3.0 * head_tokens * model.vocab * 4,
    }
    if on_gpu:
        return ProcessNeed("trainer", base + 4.0 * p, sum(parts.values()), {"imports": base, **parts})
    parts["free heap kept between steps"] = float(min(HEAP_KEPT_BYTES, sum(parts.values()) / 2))
    parts = {"imports": base, **parts}
    return ProcessNeed("trainer", sum(parts.values()), 0.0, parts)


def inference_need(model: ModelShape, dtype_bytes: int, max_batch_size: int, max_model_len: int,
                   on_gpu: bool, forked: bool = False) -> ProcessNeed:
    base = (BASE_MB if forked else FRESH_MB)["inference"] * MB
    weights = float(model.params * dtype_bytes)
    kv = float(max_batch_size * max_model_len * model.layers * 2 * model.kv_heads * model.head_dim * dtype_bytes)
    if on_gpu:
        return ProcessNeed("inference", base + weights, weights + kv, {"imports": base, "weights": weights,
                                                                       "kv cache": kv})
    parts = {"imports": base, "weights (and a CPU kernel copy)": 2 * weights,
             "the next version while it loads (tensors and file pages)": 2 * weights, "kv cache": kv}
    return ProcessNeed("inference", sum(parts.values()), 0.0, parts)


def estimate_rl(cfg: Any, model: ModelShape, on_gpu: bool = False) -> list[ProcessNeed]:
    """Each process of `rl` for an `RLConfig` (after its validators: the process configs are built from it)."""
    from primerl.config.rl import DeviceAssignment

    gpus = [0] if on_gpu else []
    inference, _, trainer = cfg.process_configs(DeviceAssignment(gpus, gpus), base_url="http://127.0.0.1:0")
    dtype = inference.model.dtype
    dtype_bytes = DTYPE_BYTES.get(dtype, 2 if on_gpu else 4) if dtype != "auto" else (2 if on_gpu else 4)
    max_len = inference.max_model_len or cfg.seq_len
    backward_bf16 = not on_gpu and trainer.train.backward_dtype != "float32" and bool(cpu_has_bf16_dot_products())
    forked = cfg.preload and not on_gpu  # the launcher preloads and forks the server and the trainer (docs/rl.md)
    return [
        ProcessNeed("launcher", (PRELOADED_LAUNCHER_MB if forked else BASE_MB["launcher"]) * MB),
        inference_need(model, dtype_bytes, inference.max_batch_size, max_len, on_gpu, forked),
        ProcessNeed("orchestrator", BASE_MB["orchestrator"] * MB + TOKENIZER_BYTES_PER_TOKEN * model.vocab,
                    parts={"imports": BASE_MB["orchestrator"] * MB, "tokenizer": TOKENIZER_BYTES_PER_TOKEN * model.vocab}),
        trainer_need(model, cfg.seq_len, trainer.train.micro_batch_rows or 1, on_gpu, backward_bf16,
                     trainer.train.logprob_chunk_tokens, trainer.train.activation_checkpointing, forked),
    ]


def available_bytes() -> float | None:
    """MemAvailable of /proc/meminfo: what the machine can give without swapping."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024.0
    except OSError:
        return None
    return None


def fit_line(needs: list[ProcessNeed], available: float) -> tuple[bool, str]:
    """(fits, one line): each process's estimate, their sum, and what the machine has."""
    total = sum(n.host_bytes for n in needs)
    each = ", ".join(f"{n.role} {n.host_bytes / 2**30:.2f}" for n in needs)
    line = f"estimated peak {total / 2**30:.2f} GiB ({each}) against {available / 2**30:.2f} GiB available"
    return total <= available, line


def peak_rss_bytes(pid: int) -> float | None:
    """VmHWM of a live process: the most resident memory it has held so far."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024.0
    except OSError:
        return None
    return None


def check_memory_fit(ctx: Any) -> str:
    """The checklist step: estimate every process's peak for the recipe's rl stage on this machine and compare the
    sum with MemAvailable (and each GPU process's with the GPU's memory); Fail in one line when it will not fit."""
    from primerl.checklist.context import Fail, Skip
    from primerl.models import resolve_model
    from primerl.recipes.stages import validate_stage

    if ctx.recipe is None:
        raise Skip("no recipe given: no sizes to estimate from")
    if "rl" not in ctx.recipe.stages:
        raise Skip("the recipe has no rl stage (the estimate covers rl runs)")
    cfg = validate_stage(ctx.recipe, "rl", run_dir=ctx.run_dir)
    shape = ModelShape.read(resolve_model(cfg.model.name, cfg.model.revision, progress=False))
    on_gpu = ctx.gpu_recipe() and ctx.gpu_count > 0
    needs = estimate_rl(cfg, shape, on_gpu=on_gpu)
    available = available_bytes()
    if available is None:
        raise Skip("cannot read MemAvailable from /proc/meminfo")
    fits, line = fit_line(needs, available)
    if on_gpu:
        gpu_gib = min(g["memory_gb"] for g in ctx.torch_facts()["gpus"])
        gpu_need = max(n.gpu_bytes for n in needs) / 2**30
        line += f"; GPU {gpu_need:.1f} GiB of {gpu_gib:g} GiB"
        fits = fits and gpu_need <= gpu_gib
    if not fits:
        raise Fail(f"will not fit: {line}")
    return line
