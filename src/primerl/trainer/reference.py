"""The KL penalty to a frozen reference model (`trainer.reference`), computed inside the trainer.

Contract: `build_reference` loads a frozen copy of the initial policy (the model the run starts from, without LoRA,
sharded like the policy); `fill_reference_logprobs` puts its log-probs of each micro-batch's tokens, at the step's
temperature, into `mb["ref_logprobs"]` before the step; `reference_kl` is the per-token estimate of KL(p || ref) from
tokens sampled by p (d = log p - log ref): k1 = d, k2 = d^2 / 2, k3 = e^-d - 1 + d (non-negative, unbiased), in
float64 with the gradient of log p. The trainer adds kl_coef times its (normalised) token sum to the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from primerl.config.trainer import LoraConfig

if TYPE_CHECKING:
    from primerl.trainer.core import MicroBatch, Trainer
    from primerl.trainer.model import Policy


def reference_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL(p || ref) estimate (float64; the gradient flows into `logprobs`)."""
    d = logprobs.double() - ref_logprobs.double()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2 or k3)")


def build_reference(trainer: Trainer) -> Policy:
    """A frozen copy of the model the run starts from: no LoRA, no activation checkpointing, no gradients."""
    from primerl.trainer.model import build_policy

    parts = trainer.parts
    train = parts.train.model_copy(update={"activation_checkpointing": False})
    reference, _ = build_policy(parts.model, train, LoraConfig(), trainer.device, trainer.dist)
    reference.eval()
    reference.requires_grad_(False)
    return reference


@torch.no_grad()
def fill_reference_logprobs(trainer: Trainer, reference: Policy, batch: Sequence[MicroBatch], temperature: float) -> None:
    """`mb["ref_logprobs"]`: the reference model's log-probs of each micro-batch's tokens (0 off the loss mask)."""
    for mb in batch:
        out = trainer.forward(mb, temperature, policy=reference)
        mb["ref_logprobs"] = out.logprobs.float() * mb["loss_mask"]
