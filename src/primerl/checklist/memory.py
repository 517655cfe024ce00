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

On GPUs (`estimate_rl(..., on_gpu=True)`) each process's device memory is estimated as the process allocates it, and
the processes are placed on devices the way `rl` places them (`RLConfig.assign_devices`): on one GPU the trainer and
the inference server share it, so their needs add up on that device, and each device's sum is compared with its
memory (`gpu_fit_line`).

    trainer      AdamW's 16 bytes a parameter (sharded over the ranks with FSDP), the bfloat16 copy autocast keeps of
                 the weights, the activations of one micro-batch as the trainer resolves it (`micro_batch_rows`, or
                 when unset `primerl.trainer.core.auto_micro_batch_rows`: 16,384 tokens a pass on a GPU, 8 rows of
                 2,048), the log-prob head's chunk, and the CUDA context
    inference    the embedded engine: the weights, its KV cache as `LlamaDecoder._reserve` allocates it (max_batch_size
                 rows of a capacity that doubles from 256 to cover the longest row, plus one spare position; see
                 `embedded_kv_capacity`), its static logits (max_batch_size x vocabulary, float32) and the CUDA
                 context; vLLM: gpu_memory_utilization x the device's memory, which it claims at start (weights and
                 KV cache inside it)

The GPU figures are not fitted to measured peaks the way the CPU figures are: one inference process was measured
(benchmarks/results/memory_fit.json, `gpu`).
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
CUDA_CONTEXT_BYTES = 512 * MB  # a process's CUDA context and kernel images, outside torch's allocator
# The longest prompt the embedded engine's KV estimate allows for (tokens; a row is prompt + max_tokens): the shipped
# single-turn environments send tens of tokens (31-35 for reverse-text). A longer prompt (a multi-turn history, long
# documents) can push the cache to the next power of two, doubling it: an underestimate, the dangerous direction.
PROMPT_ALLOWANCE_TOKENS = 256


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
    max_positions: int = 0  # max_position_embeddings: the engine's max_model_len when none is set (0: not known)

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
                   head_dim=config.get("head_dim") or hidden // heads,
                   max_positions=config.get("max_position_embeddings") or 0)


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
    """One process's estimated peak: resident host memory and, on a GPU, device memory (bytes), with its parts (of
    the device memory on a GPU, of the host memory otherwise).
    `gpus` are the devices it runs on (indices of the host's GPUs); `gpu_bytes` is what it takes on each of them.
    `copies` processes of this role run (the trainer's ranks): `host_bytes` counts them all."""

    role: str
    host_bytes: float
    gpu_bytes: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    gpus: tuple[int, ...] = ()
    copies: int = 1

    def as_json(self) -> dict[str, Any]:
        return {"role": self.role, "host_gib": round(self.host_bytes / 2**30, 3),
                "gpu_gib": round(self.gpu_bytes / 2**30, 3), "gpus": list(self.gpus),
                "parts_mb": {k: round(v / MB, 1) for k, v in self.parts.items()}}


def trainer_need(model: ModelShape, seq_len: int, micro_batch_rows: int, on_gpu: bool, backward_bf16: bool,
                 chunk_tokens: int, activation_checkpointing: bool = False, forked: bool = False,
                 ranks: int = 1, gpus: tuple[int, ...] = ()) -> ProcessNeed:
    """One trainer rank's peak. On a GPU, `ranks` > 1 shards the weights, gradients and AdamW's moments (FSDP2);
    autocast keeps a bfloat16 copy of the weights through the backward (`backward_bf16` is the CPU's choice)."""
    base = (BASE_MB if forked else FRESH_MB)["trainer"] * MB
    p = model.params
    tokens = seq_len * micro_batch_rows
    per_token = (ACTIVATION_HIDDEN * model.hidden + ACTIVATION_MLP * model.mlp) * 4
    layers = 1 if activation_checkpointing else model.layers
    head_tokens = min(tokens, chunk_tokens)
    parts = {
        "weights, gradients, AdamW (16 B/param)": 16.0 * p / (ranks if on_gpu else 1),
        "bfloat16 weight copy": 2.0 * p if backward_bf16 or on_gpu else 0.0,
        "activations": float(tokens * per_token * layers + (model.layers * tokens * model.hidden * 4
                                                             if activation_checkpointing else 0)),
        "log-prob head": 3.0 * head_tokens * model.vocab * 4,
    }
    if on_gpu:
        parts["CUDA context"] = float(CUDA_CONTEXT_BYTES)
        return ProcessNeed("trainer", (base + 4.0 * p) * ranks, sum(parts.values()), parts, gpus=gpus, copies=ranks)
    parts["free heap kept between steps"] = float(min(HEAP_KEPT_BYTES, sum(parts.values()) / 2))
    parts = {"imports": base, **parts}
    return ProcessNeed("trainer", sum(parts.values()), 0.0, parts)


def embedded_kv_capacity(longest_row: int, max_len: int) -> int:
    """The positions per row the embedded engine's KV cache holds once a row of `longest_row` positions has been
    decoded (`LlamaDecoder._reserve`): a capacity that doubles from 256 until it covers the row, at most max_len,
    plus the spare position it keeps at the end."""
    from primerl.inference.engines.llama import cache_capacity  # torch: imported only for a GPU estimate

    return cache_capacity(longest_row, max_len) + 1


def kv_bytes(model: ModelShape, dtype_bytes: int, rows: int, positions: int) -> float:
    """Keys and values of every layer for `rows` rows of `positions` positions."""
    return float(rows * positions * model.layers * 2 * model.kv_heads * model.head_dim * dtype_bytes)


def inference_need(model: ModelShape, dtype_bytes: int, max_batch_size: int, max_model_len: int,
                   on_gpu: bool, forked: bool = False, longest_row: int | None = None, engine: str = "hf",
                   gpu_memory_utilization: float = 0.9, device_bytes: float | None = None,
                   gpus: tuple[int, ...] = ()) -> ProcessNeed:
    """The inference server's peak. On a GPU: the embedded engine ("hf") sizes its KV cache for `longest_row`
    positions (`embedded_kv_capacity`; None: max_model_len); vLLM claims gpu_memory_utilization of each of its
    devices (`device_bytes`, which it then needs). On a CPU the KV term is max_batch_size x max_model_len, the figure
    the CPU peaks were fitted with."""
    base = (BASE_MB if forked else FRESH_MB)["inference"] * MB
    weights = float(model.params * dtype_bytes)
    if not on_gpu:
        kv = kv_bytes(model, dtype_bytes, max_batch_size, max_model_len)
        parts = {"imports": base, "weights (and a CPU kernel copy)": 2 * weights,
                 "the next version while it loads (tensors and file pages)": 2 * weights, "kv cache": kv}
        return ProcessNeed("inference", sum(parts.values()), 0.0, parts)
    if engine == "vllm":
        if device_bytes is None:
            raise ValueError("vLLM's share of a GPU is gpu_memory_utilization x the device's memory: give device_bytes")
        claimed = gpu_memory_utilization * device_bytes
        return ProcessNeed("inference", base + weights, claimed,
                           {f"gpu_memory_utilization {gpu_memory_utilization:g} of the device": claimed}, gpus=gpus)
    positions = embedded_kv_capacity(longest_row or max_model_len, max_model_len)
    parts = {"weights": weights, f"kv cache ({max_batch_size} rows x {positions} positions)":
             kv_bytes(model, dtype_bytes, max_batch_size, positions),
             "static logits (rows x vocabulary, float32)": float(max_batch_size * model.vocab * 4),
             "CUDA context": float(CUDA_CONTEXT_BYTES)}
    return ProcessNeed("inference", base + weights, sum(parts.values()), parts, gpus=gpus)


def estimate_rl(cfg: Any, model: ModelShape, on_gpu: bool = False, gpu_count: int = 1,
                device_bytes: float | None = None, prompt_tokens: int = PROMPT_ALLOWANCE_TOKENS) -> list[ProcessNeed]:
    """Each process of `rl` for an `RLConfig` (after its validators: the process configs are built from it), on a
    host with `gpu_count` GPUs of `device_bytes` each when `on_gpu` (placed as `rl` places them).

    The embedded engine's longest row is taken as `prompt_tokens` + sampling.max_tokens + two chunks of decode steps
    (a row may run that far past its end before the host sees it), at most max_model_len. Not seq_len: a row longer
    than seq_len is dropped by the orchestrator only after the engine decoded it, and a seq_len bound would size the
    cache for the longest trainable row, twice or more what short-prompt runs allocate."""
    from primerl.config.rl import DeviceAssignment

    devices = cfg.assign_devices(gpu_count) if on_gpu else DeviceAssignment([], [])
    cfg = cfg.with_devices(devices)
    inference, orchestrator, trainer = cfg.process_configs(devices, base_url="http://127.0.0.1:0")
    dtype = inference.model.dtype
    dtype_bytes = DTYPE_BYTES.get(dtype, 2 if on_gpu else 4) if dtype != "auto" else (2 if on_gpu else 4)
    backward_bf16 = not on_gpu and trainer.train.backward_dtype != "float32" and bool(cpu_has_bf16_dot_products())
    forked = cfg.preload and not on_gpu  # the launcher preloads and forks the server and the trainer (docs/rl.md)
    inference_on_gpu = on_gpu and bool(devices.inference)
    trainer_on_gpu = on_gpu and bool(devices.trainer)
    if inference_on_gpu:
        # the engine's own limit when none is set: the model's max_position_embeddings (engines/hf.py)
        limit = model.max_positions or inference.max_model_len or cfg.seq_len
        max_len = min(inference.max_model_len or limit, limit)
    else:
        max_len = inference.max_model_len or cfg.seq_len
    longest_row = prompt_tokens + orchestrator.sampling.max_tokens + 2 * inference.decode_steps
    micro_batch_rows = trainer.train.micro_batch_rows or _auto_micro_batch_rows(cfg.seq_len, trainer_on_gpu)
    return [
        ProcessNeed("launcher", (PRELOADED_LAUNCHER_MB if forked else BASE_MB["launcher"]) * MB),
        inference_need(model, dtype_bytes, inference.max_batch_size, max_len, inference_on_gpu, forked,
                       longest_row=longest_row, engine=inference.engine,
                       gpu_memory_utilization=inference.vllm.gpu_memory_utilization, device_bytes=device_bytes,
                       gpus=tuple(devices.inference) if inference_on_gpu else ()),
        ProcessNeed("orchestrator", BASE_MB["orchestrator"] * MB + TOKENIZER_BYTES_PER_TOKEN * model.vocab,
                    parts={"imports": BASE_MB["orchestrator"] * MB, "tokenizer": TOKENIZER_BYTES_PER_TOKEN * model.vocab}),
        trainer_need(model, cfg.seq_len, micro_batch_rows, trainer_on_gpu, backward_bf16,
                     trainer.train.logprob_chunk_tokens, trainer.train.activation_checkpointing, forked,
                     ranks=devices.trainer_ranks if trainer_on_gpu else 1,
                     gpus=tuple(devices.trainer) if trainer_on_gpu else ()),
    ]


def _auto_micro_batch_rows(seq_len: int, on_gpu: bool) -> int:
    """`train.micro_batch_rows` unset: the rows per pass the trainer picks for rows of seq_len tokens."""
    import torch

    from primerl.trainer.core import auto_micro_batch_rows

    return auto_micro_batch_rows(seq_len, torch.device("cuda" if on_gpu else "cpu"))


def device_needs(needs: list[ProcessNeed]) -> dict[int, list[ProcessNeed]]:
    """The processes on each GPU: colocated ones (the one-GPU default of `rl`) share its memory."""
    on: dict[int, list[ProcessNeed]] = {}
    for need in needs:
        for gpu in need.gpus:
            on.setdefault(gpu, []).append(need)
    return dict(sorted(on.items()))


def gpu_fit_line(needs: list[ProcessNeed], device_bytes: dict[int, float]) -> tuple[bool, str]:
    """(fits, one line): per GPU, each process's estimate there, their sum, and the device's memory."""
    fits, each = True, []
    for gpu, here in device_needs(needs).items():
        total, have = sum(n.gpu_bytes for n in here), device_bytes[gpu]
        fits = fits and total <= have
        who = " + ".join(f"{n.role} {n.gpu_bytes / 2**30:.2f}{_kv_size(n)}" for n in here)
        each.append(f"GPU {gpu} {total / 2**30:.2f} GiB ({who}) of {have / 2**30:.2f} GiB")
    return fits, ", ".join(each)


def _kv_size(need: ProcessNeed) -> str:
    """' (kv 256 rows x 1025 positions)' for the embedded engine: the assumption a reader checks against the recipe."""
    sized = [part[len("kv cache ("):-1] for part in need.parts if part.startswith("kv cache (")]
    return f" (kv {sized[0]})" if sized else ""


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
    sum with MemAvailable (and, on GPUs, the sum of the processes on each device with its memory); Fail in one line
    when it will not fit."""
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
    gpus = {i: g["memory_gb"] * 2**30 for i, g in enumerate(ctx.torch_facts()["gpus"])} if on_gpu else {}
    try:
        needs = estimate_rl(cfg, shape, on_gpu=on_gpu, gpu_count=len(gpus),
                            device_bytes=min(gpus.values()) if gpus else None)
    except ValueError as e:  # a device layout `rl` would refuse too
        raise Fail(f"cannot place the processes: {e}") from None
    available = available_bytes()
    if available is None:
        raise Skip("cannot read MemAvailable from /proc/meminfo")
    fits, line = fit_line(needs, available)
    if on_gpu:
        gpu_fits, gpu_line = gpu_fit_line(needs, gpus)
        line += f"; {gpu_line}"
        if not gpu_fits:
            line += micro_batch_hint(cfg, shape, gpus, needs)
        fits = fits and gpu_fits
    if not fits:
        raise Fail(f"will not fit: {line}")
    return line


def micro_batch_hint(cfg: Any, shape: ModelShape, gpus: dict[int, float], needs: list[ProcessNeed]) -> str:
    """For a GPU run that does not fit (`needs`, its estimate on `gpus`): the most trainer rows per pass with which it
    would (`trainer.train.micro_batch_rows`; fewer rows a pass take more passes a step, the same step), or that one
    row does not suffice."""
    trainer = next(n for n in needs if n.role == "trainer")
    if not trainer.gpus:
        return ""
    rows = cfg.trainer.train.micro_batch_rows or _auto_micro_batch_rows(cfg.seq_len, on_gpu=True)
    for fewer in range(rows - 1, 0, -1):
        trial = cfg.model_copy(deep=True)
        trial.trainer.train.micro_batch_rows = fewer
        if gpu_fit_line(estimate_rl(trial, shape, on_gpu=True, gpu_count=len(gpus),
                                    device_bytes=min(gpus.values())), gpus)[0]:
            return f"; with trainer.train.micro_batch_rows = {fewer} (now {rows}) it would fit"
    return ("; not even with one trainer row a pass: turn on trainer.train.activation_checkpointing, lower "
            "inference.max_batch_size, or give the trainer its own GPU")
