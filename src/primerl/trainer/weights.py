"""Policy versions for inference: `weights/step_<k>/` on disk, or a broadcast to the inference receivers.

One export plan (`export_plan`) says what inference loads — transformers names, LoRA adapters merged into their base
weights (W + α/r · BA), a tied output head sent once, floating tensors cast to the export dtype — and both transfers
follow it:
- filesystem: the full state dict gathered on rank 0, written as a Hugging Face model directory and published
  atomically with the `STABLE` marker last (primerl.transport.snapshots);
- broadcast: every rank gathers one tensor at a time (`DTensor.full_tensor()`), rank 0 packs them into buckets and
  broadcasts them (primerl.transport.broadcast); then a small marker directory (`BROADCAST` + `STABLE`) is published.
`WeightPublisher` picks the transfer per step, falls back to the filesystem when the group cannot form or a transfer
fails, and keeps the run directory loadable (the last step, and checkpoint steps, are always written in full).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from primerl.config.trainer import WeightsConfig
from primerl.trainer import dist as tdist
from primerl.trainer.dist import DistInfo
from primerl.trainer.model import Policy
from primerl.transport import snapshots
from primerl.transport.broadcast import (
    BroadcastSender,
    GroupFormationError,
    TensorSpec,
    WeightTransferError,
    dtype_name,
    plan_buckets,
)
from primerl.transport.shared import SharedSegment
from primerl.transport.shared import marker as shared_marker

log = logging.getLogger(__name__)

POLICY_PREFIX = "lm."
PEFT_PREFIX = "base_model.model."
ADAPTER = "default"


@dataclass(frozen=True)
class ExportTensor:
    """One tensor inference loads: its transformers name, and how it is made from the policy's state dict."""

    name: str
    key: str  # state-dict key (policy prefix removed) of the tensor, or of the base weight a LoRA pair folds into
    shape: tuple[int, ...]
    dtype: torch.dtype
    lora: tuple[str, str] | None = None  # keys of (lora_A, lora_B)
    lora_scale: float = 0.0  # alpha / r

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.key, *(self.lora or ()))

    def build(self, get: Callable[[str], Tensor]) -> Tensor:
        """The exported tensor from the full tensors `get(key)` returns."""
        value = get(self.key)
        if self.lora is not None:
            a, b = (get(key).float() for key in self.lora)
            value = value.float() + self.lora_scale * (b @ a)
        return value.to(self.dtype)


def export_plan(policy: Policy, dtype: torch.dtype) -> list[ExportTensor]:
    """What inference gets, in state-dict order (the same on every rank: no communication)."""
    lm = policy.lm
    scale = 0.0
    if hasattr(lm, "peft_config"):
        lora = lm.peft_config[ADAPTER]
        scale = lora.lora_alpha / lora.r
    tied = getattr(policy.causal_lm.config, "tie_word_embeddings", False)
    plan = []
    for full_key, value in policy.state_dict().items():
        key = full_key.removeprefix(POLICY_PREFIX)
        if ".lora_A." in key or ".lora_B." in key:
            continue
        name = key.removeprefix(PEFT_PREFIX)
        lora = None
        if ".base_layer." in name:
            module = key.split(".base_layer.")[0]
            name = name.replace(".base_layer.", ".")
            if name.endswith(".weight"):
                lora = (f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight")
        if tied and name == "lm_head.weight":
            continue  # one tensor; transformers and the engines re-tie it
        out_dtype = dtype if value.is_floating_point() else value.dtype
        plan.append(ExportTensor(name, key, tuple(value.shape), out_dtype, lora, scale if lora else 0.0))
    return plan


def full_state_dict(policy: Policy, dist: DistInfo) -> dict[str, Tensor] | None:
    """Every parameter and buffer of the language model, unsharded, on CPU, on rank 0 (None on other ranks).
    Collective: all ranks must call it."""
    if dist.world_size == 1:
        state = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not dist.is_main:
            return None
    return {k.removeprefix(POLICY_PREFIX): v for k, v in state.items()}


def export_weights(
    policy: Policy, tokenizer, run_dir: str | Path, step: int, dtype: torch.dtype, dist: DistInfo,
    broadcast: dict[str, Any] | None = None,
) -> Path | None:
    """Write and publish `weights/step_<step>/` (rank 0 writes; returns its path there, None elsewhere). With
    `broadcast`, the directory also holds that `BROADCAST` marker (the version was broadcast as well)."""
    plan = export_plan(policy, dtype)
    state = full_state_dict(policy, dist)
    if state is None:
        return None
    tensors = {entry.name: entry.build(state.__getitem__).contiguous() for entry in plan}
    staged = snapshots.staging_dir(run_dir, step)
    save_file(tensors, str(staged / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
    config = policy.causal_lm.config
    config_dict = config.to_dict()
    config_dict["dtype"] = dtype_name(dtype)
    config_dict["use_cache"] = True
    (staged / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    generation_config = getattr(policy.causal_lm, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    if broadcast is not None:
        snapshots.write_broadcast_marker(staged, broadcast)
    return snapshots.publish(staged, run_dir, step)


def _full(tensor: Tensor) -> Tensor:
    """The whole tensor on every rank (an all-gather for a sharded DTensor)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class WeightPublisher:
    """Publishes policy versions per `weights` (docs/weights.md). Every method is collective: all ranks call it.

    filesystem: each due step is exported in full. broadcast: rank 0 forms the weight group at construction (all
    ranks learn the outcome); each due step but the last is broadcast and published as a marker directory, checkpoint
    steps (`also_full`) and the last step are written in full too. If the group cannot form, or a transfer fails,
    the rest of the run uses the filesystem (`label` says so in every metrics record)."""

    def __init__(self, cfg: WeightsConfig, policy: Policy, tokenizer, run_dir: Path, dtype: torch.dtype,
                 dist: DistInfo, device: torch.device):
        self.cfg = cfg
        self.policy, self.tokenizer, self.run_dir = policy, tokenizer, Path(run_dir)
        self.dtype, self.dist, self.device = dtype, dist, device
        self.mode = cfg.transfer
        self.label = cfg.transfer
        self.sender: BroadcastSender | None = None
        self.segment: SharedSegment | None = None
        if cfg.transfer == "broadcast":
            self._form_group()
        elif cfg.transfer == "shared" and dist.is_main:
            plan = export_plan(policy, dtype)
            self.segment = SharedSegment(run_dir, [(e.name, e.shape) for e in plan], dtype, device)
            log.info("weights: shared %s buffer of %.1f MB for inference on the same device",
                     device.type, self.segment.num_bytes / 1e6)

    def _form_group(self) -> None:
        b = self.cfg.broadcast
        error = None
        if self.dist.is_main:
            sender = BroadcastSender(b.host, b.port, b.receivers, backend=b.backend, device=self.device,
                                     init_timeout_s=b.init_timeout_s, timeout_s=b.timeout_s)
            try:
                sender.form()
                self.sender = sender
            except GroupFormationError as e:
                error = str(e)
        if not self._agree(error is None):
            self._fall_back(error or "rank 0 could not form the weight group")

    def _agree(self, ok: bool) -> bool:
        """True when `ok` holds on every rank."""
        failures = torch.tensor([0.0 if ok else 1.0], device=self.device)
        return float(tdist.all_reduce_sum(failures)) == 0.0

    def _fall_back(self, reason: str) -> None:
        self.mode, self.label = "filesystem", f"filesystem (fallback: {reason})"
        if self.sender is not None:
            self.sender.close(f"the trainer fell back to the filesystem: {reason}")
            self.sender = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        if self.dist.is_main:
            log.warning("WEIGHT BROADCAST UNAVAILABLE: %s -- the rest of the run publishes full weights on the "
                        "filesystem instead", reason)

    def resumed(self, step: int) -> None:
        """After resuming at `step` (0: no checkpoint). Staging leftovers of a killed export go, and so do snapshots
        newer than `step`: their steps are trained again, and a server must never load the old version k when the
        new one is published (on a GPU they differ). A restarted server holds nothing that was broadcast or shared, so
        when the run uses (or used) those, version `step` is made loadable from disk; what comes next travels through
        the group."""
        uses_markers = self.cfg.transfer in ("broadcast", "shared") or any(
            snapshots.broadcast_marker(snapshots.weights_dir(self.run_dir, s)) is not None
            or shared_marker(snapshots.weights_dir(self.run_dir, s)) is not None
            for s in snapshots.stable_steps(self.run_dir))
        if self.dist.is_main:
            if leftovers := snapshots.remove_staging_leftovers(self.run_dir):
                log.info("resume: removed staging leftovers of a killed export: %s", ", ".join(leftovers))
            if removed := snapshots.remove_after(self.run_dir, step):
                log.info("resume: removed weight snapshots %s (newer than checkpoint step %d)", removed, step)
        if not self._agree(not uses_markers):
            path = snapshots.weights_dir(self.run_dir, step)
            on_disk = snapshots.is_stable(path) and snapshots.has_files(path)
            if step > 0 and not self._agree(on_disk):
                export_weights(self.policy, self.tokenizer, self.run_dir, step, self.dtype, self.dist)
                if self.dist.is_main:
                    log.info("resume: wrote weights/step_%d in full for the restarted inference server", step)

    def publish(self, step: int, is_last: bool, also_full: bool) -> dict[str, Any]:
        """Publish policy version `step`; return its metrics."""
        metrics: dict[str, Any] = {}
        marker = None
        if self.mode == "shared" and not is_last and not also_full and self._share(step, metrics):
            if self.dist.is_main and self.cfg.keep_last is not None:
                snapshots.prune(self.run_dir, self.cfg.keep_last)
            metrics["weight_transfer"] = self.label
            return metrics
        if self.mode == "broadcast" and not is_last:
            marker = self._broadcast(step, metrics)
        started = time.perf_counter()
        if marker is None or also_full:
            export_weights(self.policy, self.tokenizer, self.run_dir, step, self.dtype, self.dist, broadcast=marker)
        elif self.dist.is_main:
            staged = snapshots.staging_dir(self.run_dir, step)
            snapshots.write_broadcast_marker(staged, marker)
            snapshots.publish(staged, self.run_dir, step)
        if self.dist.is_main and self.cfg.keep_last is not None:
            snapshots.prune(self.run_dir, self.cfg.keep_last)
        if marker is None or also_full:
            metrics["weights_export_s"] = time.perf_counter() - started
        metrics["weight_transfer"] = self.label
        return metrics

    def _share(self, step: int, metrics: dict[str, Any]) -> bool:
        """Put version `step` into the shared buffer and publish its marker directory; False after a fall-back
        (the server did not confirm the previous version in time: this and later versions go to the filesystem)."""
        started = time.perf_counter()
        segment = self.segment
        ok = segment is None or segment.wait_until_applied(self.cfg.shared_timeout_s)
        if not self._agree(ok):
            self._fall_back(f"inference did not apply shared weights step {segment.written if segment else '?'} "
                            f"within {self.cfg.shared_timeout_s:.0f}s")
            return False
        waited = time.perf_counter() - started
        state = self.policy.state_dict()
        tensors = {}
        for entry in export_plan(self.policy, self.dtype):  # every rank takes part in the gathers
            value = entry.build(lambda key: _full(state[POLICY_PREFIX + key]))
            if segment is not None:
                tensors[entry.name] = value
        if segment is not None:
            segment.fill(tensors)
            segment.publish(step)
        metrics.update(weights_shared_s=time.perf_counter() - started - waited, weights_shared_wait_s=waited)
        return True

    def _broadcast(self, step: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """Send version `step` through the group; the marker to publish (on every rank), or None after a failure
        (the publisher has then fallen back)."""
        plan = export_plan(self.policy, self.dtype)
        bucket_bytes = self.cfg.broadcast.bucket_mb * 2**20
        manifest = plan_buckets([TensorSpec(e.name, e.dtype, e.shape) for e in plan], bucket_bytes)
        sender = self.sender
        error: str | None = None
        if sender is not None:
            try:
                sender.begin(step, manifest)
            except WeightTransferError as e:
                error = str(e)
        if not self._agree(error is None):
            self._fall_back(error or "rank 0 could not start the transfer")
            return None
        state = self.policy.state_dict()
        by_name = {entry.name: entry for entry in plan}
        stats = None
        for index, bucket in enumerate(manifest.buckets):
            entries = [by_name[t.name] for t in bucket.tensors]
            if sender is None:  # not rank 0: take part in the gathers only
                for entry in entries:
                    for key in entry.sources:
                        _full(state[POLICY_PREFIX + key])
                continue
            tensors = [entry.build(lambda key: _full(state[POLICY_PREFIX + key])) for entry in entries]
            if error is None:
                try:
                    sender.send_bucket(index, tensors)
                except WeightTransferError as e:
                    error = str(e)  # keep gathering: the other ranks are in the loop too
            del tensors
        if sender is not None and error is None:
            try:
                stats = sender.end()
            except WeightTransferError as e:
                error = str(e)
        if not self._agree(error is None):
            self._fall_back(error or "the transfer failed on rank 0")
            return None
        if stats is None:
            return {}
        backend = sender.backend if sender is not None else None
        log.info("weights step %d: broadcast to %d receiver(s) over %s in %.2fs: %d tensors, %.1f MB, %d bucket(s)",
                 step, self.cfg.broadcast.receivers, backend, stats.seconds, stats.num_tensors, stats.num_bytes / 1e6,
                 stats.num_buckets)
        metrics.update(weights_broadcast_s=stats.seconds, weights_broadcast_bytes=stats.num_bytes,
                       weights_broadcast_buckets=stats.num_buckets)
        return {"step": step, "transfer_id": stats.transfer_id, "backend": backend,
                "receivers": self.cfg.broadcast.receivers, "seconds": round(stats.seconds, 4), **manifest.summary()}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close("the trainer finished")
            self.sender = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None
