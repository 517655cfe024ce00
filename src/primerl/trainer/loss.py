"""RL losses. A loss is a callable `loss(inputs: LossInputs, **kwargs) -> LossOutput`, chosen in the config by
`loss.path = "module:callable"` with `loss.kwargs`.

Contract:
- Tensors in `LossInputs` share one shape (a micro-batch of packed rows, [rows, seq_len]); `loss_mask` is True on
  tokens the policy sampled. Everything off the mask must not contribute to the loss or the metrics.
- `LossOutput.loss_sum` is the SUM of per-token losses over the micro-batch. The trainer divides it by the number of
  loss tokens of the whole step (all micro-batches, all ranks), so every token weighs the same however the step is
  split. `LossOutput.metrics` are likewise token sums; the trainer reports each as a mean over the step's loss tokens.

Formulas (per token t with advantage A, trainer log-prob log p, inference log-prob log q): docs/trainer.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from primerl.imports import import_object

# exp() of larger log-ratios overflows float32; tokens that far off are masked out anyway.
MAX_LOG_RATIO = 20.0


@dataclass
class LossInputs:
    logprobs: Tensor  # trainer log-probs of the sampled tokens (carries the gradient)
    inference_logprobs: Tensor  # log-probs the inference engine reported for the same tokens
    advantages: Tensor
    loss_mask: Tensor  # bool
    entropy: Tensor  # trainer entropy of the next-token distribution (no gradient)


@dataclass
class LossOutput:
    loss_sum: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)  # token sums, detached


def _log_ratio(inputs: LossInputs) -> Tensor:
    """log p - log q on loss tokens (0 elsewhere), clamped so exp() stays finite."""
    delta = (inputs.logprobs - inputs.inference_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.where(inputs.loss_mask, delta, torch.zeros_like(delta))


def _mismatch_kl(log_ratio: Tensor) -> Tensor:
    """k3 estimate of KL(q || p) from tokens sampled by q: r - 1 - log r >= 0, unbiased. In float64: near r = 1 the
    three terms cancel to about (log r)^2 / 2, which float32 (and bf16 even more) rounds to noise."""
    log_ratio = log_ratio.double()
    return torch.exp(log_ratio) - 1.0 - log_ratio


def masked_importance_loss(
    inputs: LossInputs,
    pos_ratio_low: float = 0.125,
    pos_ratio_high: float = 8.0,
    neg_ratio_low: float = 0.125,
    neg_ratio_high: float = 8.0,
    kl_coef: float = 0.0,
) -> LossOutput:
    """Token-level policy gradient with importance ratio r = p / q, masking tokens whose ratio left its band.

    A token with A >= 0 is kept when pos_ratio_low <= r <= pos_ratio_high, one with A < 0 when
    neg_ratio_low <= r <= neg_ratio_high. Per kept token: -r A + kl_coef (r - 1 - log r); masked tokens give 0 (but
    still count in the normaliser, so masking shrinks the step instead of re-weighting the rest).
    """
    if not (0 <= pos_ratio_low <= 1 <= pos_ratio_high and 0 <= neg_ratio_low <= 1 <= neg_ratio_high):
        raise ValueError("ratio bands must contain 1: 0 <= low <= 1 <= high")
    mask = inputs.loss_mask
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    positive = inputs.advantages >= 0
    in_band = torch.where(
        positive,
        (r >= pos_ratio_low) & (r <= pos_ratio_high),
        (r >= neg_ratio_low) & (r <= neg_ratio_high),
    )
    keep = mask & in_band
    kl = _mismatch_kl(log_ratio)
    per_token = -ratio * inputs.advantages + kl_coef * kl.to(ratio.dtype)
    loss_sum = torch.where(keep, per_token, torch.zeros_like(per_token)).sum()
    masked = mask & ~in_band
    metrics = {
        "masked_fraction": masked.sum(),
        "masked_fraction_pos": (masked & positive).sum(),
        "masked_fraction_neg": (masked & ~positive).sum(),
        "mismatch_kl": (kl.detach() * mask).sum(),
        "importance_ratio": (r * mask).sum(),
    }
    return LossOutput(loss_sum=loss_sum, metrics={k: v.detach().double() for k, v in metrics.items()})


def ppo_clip_loss(
    inputs: LossInputs, clip_low: float = 0.2, clip_high: float = 0.28, kl_coef: float = 0.0
) -> LossOutput:
    """GRPO/PPO clipped surrogate with the inference policy as the behaviour ("old") policy:
    per token -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef (r - 1 - log r)."""
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError("need 0 <= clip_low < 1 and clip_high >= 0")
    mask = inputs.loss_mask
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    advantages = inputs.advantages
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    kl = _mismatch_kl(log_ratio)
    per_token = -surrogate + kl_coef * kl.to(surrogate.dtype)
    loss_sum = torch.where(mask, per_token, torch.zeros_like(per_token)).sum()
    clip_active = mask & (clipped.detach() < unclipped.detach())
    metrics = {
        "clipped_fraction": clip_active.sum(),
        "mismatch_kl": (kl.detach() * mask).sum(),
        "importance_ratio": (ratio.detach() * mask).sum(),
    }
    return LossOutput(loss_sum=loss_sum, metrics={k: v.detach().double() for k, v in metrics.items()})


def load_loss(path: str, kwargs: dict | None = None) -> Callable[[LossInputs], LossOutput]:
    """Import `module:callable` and bind `kwargs`; unknown keyword names fail here, not at the first step."""
    fn = import_object(path, "loss")
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as e:
        raise ValueError(f"loss {path!r} does not accept kwargs {sorted(kwargs)}: {e}") from None
    return partial(fn, **kwargs)
