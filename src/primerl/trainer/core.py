"""What RL and SFT training share: the parts of a trainer and one optimizer step over packed rows.

`Trainer` owns the policy, tokenizer, optimizer, scheduler, checkpointer and metrics log. `Trainer.step` runs the
micro-batches of one step through a `StepLoss` (forward -> loss token sum), normalises by the number of loss tokens
of the whole step (all micro-batches, all ranks), clips, steps the optimizer and returns the step's metrics.
`Trainer.finish_step` logs them and writes weights / checkpoints per the policies in the config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from primerl.config.common import ModelConfig, WandbConfig
from primerl.config.trainer import (
    CheckpointConfig,
    LoraConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainingConfig,
    WeightsConfig,
)
from primerl.cpu import trim_freed_memory
from primerl.monitor import MetricsLogger, format_line
from primerl.trainer import dist as tdist
from primerl.trainer.ckpt import Checkpointer
from primerl.trainer.loss import LossOutput
from primerl.trainer.metrics import attention_shape, peak_flops, peak_memory_gib, step_flops
from primerl.trainer.model import Policy, PolicyOutput, build_policy, count_matmul_params
from primerl.trainer.optim import build_optimizer, build_scheduler
from primerl.trainer.weights import PolicyWeights
from primerl.transport.weight_transfer.base import Publisher
from primerl.transport.weight_transfer.factory import build_publisher

log = logging.getLogger(__name__)

# the per-token arrays of a packed row that go to the device, and their torch dtypes
TENSOR_DTYPES = {
    "input_ids": torch.long,
    "position_ids": torch.long,
    "sample_index": torch.long,
    "parent_index": torch.long,
    "loss_mask": torch.bool,
    "inference_logprobs": torch.float32,
    "advantages": torch.float32,
}

CONSOLE_KEYS = [
    "loss",
    "entropy",
    "mismatch_kl",
    "masked_fraction",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "mfu",
    "peak_memory_gib",
    "wait_s",
]

MicroBatch = dict[str, Tensor]
StepLoss = Callable[[PolicyOutput, MicroBatch], LossOutput]


@dataclass
class TrainerParts:
    """The config sections a trainer is built from (RL and SFT configs both have them)."""

    run_dir: Path
    model: ModelConfig
    train: TrainingConfig
    lora: LoraConfig
    optim: OptimizerConfig
    scheduler: SchedulerConfig
    ckpt: CheckpointConfig
    weights: WeightsConfig
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)  # W&B off unless a project is set

    @classmethod
    def of(cls, cfg) -> TrainerParts:
        """The parts of an RL or SFT trainer config (both carry every section under the same names)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    def as_json(self) -> dict[str, Any]:
        return {f.name: _jsonable_part(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _jsonable_part(value: Any) -> Any:
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else str(value)


AUTO_MICRO_BATCH_TOKENS = 16384


def auto_micro_batch_rows(row_len: int, device: torch.device) -> int:
    """`train.micro_batch_rows = None`: one row per pass on the CPU; on a GPU as many rows as hold
    AUTO_MICRO_BATCH_TOKENS tokens. A small model's forward and backward on one short row is bound by kernel launches
    (P1 on an H200, SmolLM2-135M, 2,048-token rows: 2.0 s per step; the same batch in 16,384-token passes: 0.36 s)."""
    if device.type == "cpu":
        return 1
    return max(1, AUTO_MICRO_BATCH_TOKENS // max(row_len, 1))


def micro_batches(
    arrays: dict[str, np.ndarray], rows_per_micro_batch: int | None, device: torch.device
) -> list[MicroBatch]:
    """Cut this rank's rows into micro-batches of tensors on `device` (None rows: `auto_micro_batch_rows`)."""
    num_rows, row_len = arrays["input_ids"].shape
    rows_per_micro_batch = rows_per_micro_batch or auto_micro_batch_rows(row_len, device)
    out = []
    for start in range(0, num_rows, rows_per_micro_batch):
        rows = slice(start, start + rows_per_micro_batch)
        out.append(
            {
                name: torch.from_numpy(np.ascontiguousarray(arrays[name][rows])).to(device=device, dtype=dtype)
                for name, dtype in TENSOR_DTYPES.items()
                if name in arrays
            }
        )
    return out


def trimmed_width(sample_index: Tensor, multiple: int = 1) -> int:
    """Columns up to the last one that holds a token in some row (rows are padded at their tail only), rounded up to
    a multiple of `multiple` (at most all the columns): a CPU backend (oneDNN) caches a kernel for every new shape it
    sees, so a long run should show it few."""
    used = (sample_index >= 0).any(dim=0).nonzero()
    width = int(used[-1]) + 1 if len(used) else 1
    return min(-(-width // multiple) * multiple, sample_index.shape[-1])


def sample_lengths(batch: list[MicroBatch]) -> list[int]:
    """Lengths of the samples in this rank's rows (padding excluded), for the attention FLOP count."""
    lengths = []
    for mb in batch:
        for row in mb["sample_index"].cpu():
            _, counts = torch.unique_consecutive(row[row >= 0], return_counts=True)
            lengths.extend(counts.tolist())
    return lengths


class Trainer:
    """The parts of a training process. Swappable: `StepLoss` per call. Fixed: optimizer, checkpointer, metrics."""

    policy: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpointer: Checkpointer
    publisher: Publisher
    metrics: MetricsLogger

    def __init__(self, parts: TrainerParts, source: str):
        self.parts = parts
        self.dist, self.device = tdist.setup(parts.train.device)
        torch.manual_seed(parts.train.seed)
        if parts.train.deterministic:
            torch.use_deterministic_algorithms(True)
        if parts.train.threads is not None:
            torch.set_num_threads(parts.train.threads)
        self.policy, self.tokenizer = build_policy(parts.model, parts.train, parts.lora, self.device, self.dist)
        self.optimizer = build_optimizer(self.policy, parts.optim)
        self.scheduler = build_scheduler(self.optimizer, parts.scheduler, parts.train.max_steps)
        self.checkpointer = Checkpointer(parts.run_dir, parts.ckpt, self.dist)
        self.metrics = MetricsLogger(
            parts.run_dir, source, wandb=parts.wandb, config={source: parts.as_json()}, enabled=self.dist.is_main
        )
        self.export_dtype = (
            self.policy.compute_dtype if parts.weights.dtype == "auto" else getattr(torch, parts.weights.dtype)
        )
        config = self.policy.causal_lm.config
        self.matmul_params = count_matmul_params(self.policy)
        self.attention_shape = attention_shape(config)
        self.peak_flops = peak_flops(self.device, parts.train.peak_flops)
        self._log_setup()
        # last: with the broadcast transfer this waits for the inference receivers to join
        weights = PolicyWeights(self.policy, self.tokenizer, self.export_dtype, self.dist, self.device)
        self.publisher = build_publisher(parts.weights, weights, parts.run_dir)

    def _log_setup(self) -> None:
        p = self.parts
        total = sum(t.numel() for t in self.policy.parameters())
        trainable = sum(t.numel() for t in self.policy.parameters() if t.requires_grad)
        log.info(
            "model %s | params %.1fM (trainable %.1fM, matmul %.1fM) | attention %s | compute %s (backward %s) | "
            "device %s x%d",
            p.model.name,
            total / 1e6,
            trainable / 1e6,
            self.matmul_params / 1e6,
            self.policy.attention,
            str(self.policy.compute_dtype).removeprefix("torch."),
            str(self.policy.backward_dtype).removeprefix("torch."),
            self.device.type,
            self.dist.world_size,
        )
        flops = f"{self.peak_flops / 1e12:.1f} TFLOP/s" if self.peak_flops else "unknown (no MFU)"
        log.info(
            "micro-batch rows %s | activation checkpointing %s | compile %s | LoRA %s | peak FLOPs/device %s",
            p.train.micro_batch_rows or f"auto (up to {AUTO_MICRO_BATCH_TOKENS} tokens per pass on a GPU, 1 row on CPU)",
            p.train.activation_checkpointing,
            p.train.compile,
            p.lora.enabled,
            flops,
        )

    def resume(self) -> tuple[int, dict[str, Any]]:
        """Load the checkpoint chosen by `ckpt.resume`; return (completed steps, data position) — (0, {}) if none."""
        step = self.checkpointer.resume_step()
        data: dict[str, Any] = {}
        if step is not None:
            progress = self.checkpointer.load(step, self.policy, self.optimizer, self.scheduler)
            log.info("resumed from %s (step %d)", self.checkpointer.path(step), step)
            data = progress.get("data", {})
        if self.parts.ckpt.resume is not None:
            self.publisher.resumed(step or 0)  # after the load: it may write these weights
        return step or 0, data

    def forward(self, mb: MicroBatch, temperature: float, policy: Policy | None = None) -> PolicyOutput:
        """Log-probs and entropies of `policy` (default: the one trained) at the micro-batch's loss tokens (0
        elsewhere); columns that are padding in every row are left out of the forward."""
        used = trimmed_width(mb["sample_index"], self.parts.train.width_multiple)
        policy = self.policy if policy is None else policy
        with policy.autocast(self.device):
            out = policy(
                mb["input_ids"][:, :used],
                mb["position_ids"][:, :used],
                mb["sample_index"][:, :used],
                temperature,
                parent_index=mb["parent_index"][:, :used] if "parent_index" in mb else None,
                wanted=mb["loss_mask"][:, :used],
            )
        width = mb["input_ids"].shape[1]
        if used == width:
            return out
        return PolicyOutput(logprobs=F.pad(out.logprobs, (0, width - used)), entropy=F.pad(out.entropy, (0, width - used)))

    def warm_up(self, batch: list[MicroBatch], loss: StepLoss) -> None:
        """Forward and backward over `batch`, then drop the gradients: the weights and the optimizer are untouched.
        The first step's one-time work is then done before the first batch comes: on the CPU mapping fresh memory for
        the activations and gradients (which a virtual machine can make slow) and setting up the kernels, on a GPU
        compiling the fused log-prob kernels (from the compile cache after the first run) and the allocator's
        first blocks."""
        for mb in batch:
            loss(self.forward(mb, 1.0), mb).loss_sum.backward()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, batch: list[MicroBatch], loss: StepLoss, temperature: float = 1.0) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches; returns the step's metrics (same on every rank)."""
        start = time.perf_counter()
        world = self.dist.world_size
        counts = torch.tensor(
            [
                float(sum(int(mb["loss_mask"].sum()) for mb in batch)),
                float(sum(int((mb["sample_index"] >= 0).sum()) for mb in batch)),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        num_loss_tokens, num_tokens = tdist.all_reduce_sum(counts).tolist()
        # Each micro-batch contributes loss_sum / (global loss tokens); FSDP averages gradients over ranks, so the
        # world size factor turns that average back into the sum over every rank's tokens.
        scale = world / max(num_loss_tokens, 1.0)
        sums: dict[str, Tensor] = {}
        for mb in batch:
            out = self.forward(mb, temperature)
            result = loss(out, mb)
            (result.loss_sum * scale).backward()
            stats = {
                "loss": result.loss_sum.detach(),
                "entropy": (out.entropy * mb["loss_mask"]).sum(),
                **result.metrics,
            }
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value.detach().double()
        grad_norm = self._clip_gradients()  # reads the norm back: the device has finished the backward here
        backward_done = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        names = sorted(sums)
        totals = tdist.all_reduce_sum(torch.stack([torch.as_tensor(sums[k], device=self.device) for k in names]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_s = time.perf_counter() - start
        lengths = sample_lengths(batch)
        flops = torch.tensor([step_flops(self.matmul_params, *self.attention_shape, lengths)], dtype=torch.float64)
        flops = float(tdist.all_reduce_sum(flops.to(self.device)))
        metrics: dict[str, Any] = {k: float(v) / max(num_loss_tokens, 1.0) for k, v in zip(names, totals.tolist())}
        metrics.update(
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=int(num_tokens),
            num_loss_tokens=int(num_loss_tokens),
            step_s=step_s,
            forward_backward_s=backward_done - start,  # the rest of step_s: optimizer step and metric reductions
            tokens_per_s=num_tokens / step_s,
            tflops_per_device=flops / step_s / world / 1e12,
            mfu=flops / step_s / world / self.peak_flops if self.peak_flops else None,
            peak_memory_gib=peak_memory_gib(self.device),
        )
        if self.parts.train.weight_checksum:
            metrics["weight_checksum"] = weight_checksum(self.policy.causal_lm, self.dist.world_size)
        return metrics

    def _clip_gradients(self) -> float:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.parts.optim.max_grad_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def finish_step(self, step: int, metrics: dict[str, Any], data_state: dict[str, Any], is_last: bool) -> None:
        """After `step` completed optimizer steps: publish weights, checkpoint, log (in that order, so the weights'
        latency is in this step's metrics)."""
        w = self.parts.weights
        checkpoint_due = self.checkpointer.due(step, is_last)
        if (w.interval is not None and step % w.interval == 0) or is_last:
            metrics.update(self.publisher.publish(step, is_last, also_full=checkpoint_due))
        if checkpoint_due:
            start = time.perf_counter()
            self.checkpointer.save(step, self.policy, self.optimizer, self.scheduler, data_state)
            metrics["checkpoint_s"] = time.perf_counter() - start
        start = time.perf_counter()
        trimmed = trim_freed_memory()  # the step's gradients, copies and logits are free by now
        metrics["heap_trim_s"] = time.perf_counter() - start  # the check of the heap, and the trim where it fired
        if trimmed:
            metrics["heap_trimmed_gb"] = trimmed / 1e9
        record = self.metrics.log(step, metrics)
        if self.dist.is_main:
            log.info(format_line(step, record, CONSOLE_KEYS))

    def close(self) -> None:
        self.publisher.close()
        tdist.teardown()


def weight_checksum(model: torch.nn.Module, world_size: int = 1) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes, in name order: equal exactly when the weights are
    bit for bit equal. With several ranks each hashes its own shards and rank 0's digest covers all of them."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        local = param.detach()
        local = local.to_local() if hasattr(local, "to_local") else local
        digest.update(f"{name}:{local.dtype}:{tuple(local.shape)}".encode())
        digest.update(local.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    if world_size == 1:
        return digest.hexdigest()
    shards: list[str | None] = [None] * world_size
    torch.distributed.all_gather_object(shards, digest.hexdigest())
    return hashlib.sha256("".join(str(s) for s in shards).encode()).hexdigest()


def setup_logging(rank: int, name: str) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s {name}[{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
