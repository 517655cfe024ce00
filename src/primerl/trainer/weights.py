"""What the trainer exports for inference, and the trainer as the weight source of every transfer.

One export plan (`export_plan`) says what inference loads — transformers names, LoRA adapters merged into their base
weights (W + α/r · BA), a tied output head sent once, floating tensors cast to the export dtype — and every transfer
follows it: `export_weights` gathers the full state dict on rank 0 and publishes it as a Hugging Face model directory
(`STABLE` last, primerl.transport.snapshots); `PolicyWeights` hands the plan and the gathered tensors
(`DTensor.full_tensor()`, one tensor at a time on every rank) to the publishers of
primerl.transport.weight_transfer, which decide per step what is sent how, fall back, and resume.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from primerl.trainer import dist as tdist
from primerl.trainer.dist import DistInfo
from primerl.trainer.model import Policy
from primerl.transport import snapshots
from primerl.transport.buckets import TensorSpec, dtype_name

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
    marker: tuple[str, dict] | None = None,
) -> Path | None:
    """Write and publish `weights/step_<step>/` (rank 0 writes; returns its path there, None elsewhere). With
    `marker` (name, JSON), the directory also holds that marker (the version was broadcast as well)."""
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
    if marker is not None:
        snapshots.write_marker(staged, *marker)
    return snapshots.publish(staged, run_dir, step)


def _full(tensor: Tensor) -> Tensor:
    """The whole tensor on every rank (an all-gather for a sharded DTensor)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class PolicyWeights:
    """The trainer as a weight source for the publishers (primerl.transport.weight_transfer.base.WeightSource): what
    inference loads (`export_plan`) and how to gather it from the policy. Every method but `specs` is collective."""

    def __init__(self, policy: Policy, tokenizer, dtype: torch.dtype, dist: DistInfo, device: torch.device):
        self.policy, self.tokenizer, self.dtype, self.dist, self.device = policy, tokenizer, dtype, dist, device
        self.is_main = dist.is_main
        self.plan = export_plan(policy, dtype)  # names and shapes are fixed once the policy is built

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(e.name, e.dtype, e.shape) for e in self.plan]

    def gather(self, groups: Sequence[Sequence[str]]) -> Iterator[list[Tensor] | None]:
        """Per group of names: the export tensors, built from full (all-gathered) tensors, on rank 0; None on the
        other ranks, which only take part in the gathers."""
        by_name = {entry.name: entry for entry in self.plan}
        state = self.policy.state_dict()

        def full(key: str) -> Tensor:
            return _full(state[POLICY_PREFIX + key])

        for names in groups:
            entries = [by_name[name] for name in names]
            if self.is_main:
                yield [entry.build(full) for entry in entries]
                continue
            for entry in entries:
                for key in entry.sources:
                    full(key)
            yield None

    def write_full(self, run_dir: Path, step: int, marker: tuple[str, dict] | None = None) -> None:
        export_weights(self.policy, self.tokenizer, run_dir, step, self.dtype, self.dist, marker)

    def agree(self, ok: bool) -> bool:
        failures = torch.tensor([0.0 if ok else 1.0], device=self.device)
        return float(tdist.all_reduce_sum(failures)) == 0.0
