"""RL losses. A loss is a callable `loss(inputs: LossInputs, **kwargs) -> LossOutput`, chosen in the config by
`loss.type` (the built-ins below, each with its typed options) or `loss.type = "custom"` with `loss.path =
"module:callable"` and `loss.kwargs`.

Contract:
- Tensors in `LossInputs` share one shape (a micro-batch of packed rows, [rows, seq_len]); `loss_mask` is True on
  tokens the policy sampled. Everything off the mask must not contribute to the loss or the metrics.
- `LossOutput.loss_sum` is the SUM of per-token losses over the micro-batch, each weighted by `loss_weights` when
  given (the sequence and constant normalisations; None for the token one). The trainer divides it by the number of
  loss tokens of the whole step (all micro-batches, all ranks). `LossOutput.metrics` are unweighted token sums; the
  trainer reports each as a mean over the step's loss tokens.

Formulas (per token t with advantage A, trainer log-prob log p, inference log-prob log q): docs/algorithms.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from primerl.config.trainer import CISPOLoss, CustomLoss, GSPOLoss, LossConfig, MaskedImportanceLoss, PPOClipLoss
from primerl.imports import import_object

# exp() of larger log-ratios overflows float32; tokens that far off are masked out anyway.
MAX_LOG_RATIO = 20.0

LossFn = Callable[["LossInputs"], "LossOutput"]


@dataclass
class LossInputs:
    logprobs: Tensor  # trainer log-probs of the sampled tokens (carries the gradient)
    inference_logprobs: Tensor  # log-probs the inference engine reported for the same tokens
    advantages: Tensor
    loss_mask: Tensor  # bool
    entropy: Tensor  # trainer entropy of the next-token distribution (no gradient)
    sample_index: Tensor | None = None  # which sample each token belongs to (-1: padding); sequence-level losses
    loss_weights: Tensor | None = None  # per-token weight of the step's normalisation (None: 1 everywhere)
    ref_logprobs: Tensor | None = None  # the frozen reference model's log-probs (when trainer.reference is on)


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


def token_sum(per_token: Tensor, keep: Tensor, weights: Tensor | None) -> Tensor:
    """The sum of `per_token` over the tokens in `keep`, each times its normalisation weight when there are any."""
    kept = torch.where(keep, per_token, torch.zeros_like(per_token))
    return kept.sum() if weights is None else (kept * weights).sum()


def sample_means(values: Tensor, mask: Tensor, sample_index: Tensor) -> Tensor:
    """Each token's sample's mean of `values` over that sample's tokens in `mask` (0 for a sample without any)."""
    index = sample_index.clamp(min=0).reshape(-1)
    weights = mask.reshape(-1).to(values.dtype)
    size = int(index.max()) + 1 if index.numel() else 1
    sums = values.new_zeros(size).index_add(0, index, values.reshape(-1) * weights)
    counts = values.new_zeros(size).index_add(0, index, weights)
    return (sums / counts.clamp(min=1.0))[index].view_as(values)


def sample_loss_tokens(sample_index: Tensor, loss_mask: Tensor) -> Tensor:
    """Loss tokens of each sample, indexed by sample (samples never span rows, so a micro-batch holds all of each)."""
    index = sample_index.clamp(min=0).reshape(-1)
    size = int(index.max()) + 1 if index.numel() else 1
    return torch.zeros(size, dtype=torch.float64, device=index.device).index_add(
        0, index, loss_mask.reshape(-1).double())


def normalization_weights(
    sample_index: Tensor, loss_mask: Tensor, num_samples: float, num_tokens: float, normalize: str,
    normalize_tokens: int | None = None,
) -> Tensor | None:
    """Per-token weights that turn the trainer's division by the step's `num_tokens` loss tokens into another
    normalisation over the step's `num_samples` samples: "sequence" = (1 / S) sum_i (1 / L_i) sum_t, "constant" =
    (1 / S) sum_i (1 / C) sum_t (Dr. GRPO, C = normalize_tokens); None for "token" (every token weighs 1 / N)."""
    if normalize == "token":
        return None
    if normalize == "sequence":
        lengths = sample_loss_tokens(sample_index, loss_mask)[sample_index.clamp(min=0)]
    elif normalize == "constant":
        if not normalize_tokens:
            raise ValueError("normalize = 'constant' needs normalize_tokens")
        lengths = torch.full(loss_mask.shape, float(normalize_tokens), dtype=torch.float64, device=loss_mask.device)
    else:
        raise ValueError(f"unknown normalisation {normalize!r} (token, sequence or constant)")
    weights = num_tokens / (max(num_samples, 1.0) * lengths.clamp(min=1.0))
    return torch.where(loss_mask, weights, torch.zeros_like(weights))


def _detached(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().double() for k, v in metrics.items()}


def _ratio_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    return {
        "mismatch_kl": (_mismatch_kl(log_ratio).detach() * mask).sum(),
        "importance_ratio": (torch.exp(log_ratio).detach() * mask).sum(),
    }


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
    loss_sum = token_sum(per_token, keep, inputs.loss_weights)
    masked = mask & ~in_band
    metrics = {
        "masked_fraction": masked.sum(),
        "masked_fraction_pos": (masked & positive).sum(),
        "masked_fraction_neg": (masked & ~positive).sum(),
        "mismatch_kl": (kl.detach() * mask).sum(),
        "importance_ratio": (r * mask).sum(),
    }
    return LossOutput(loss_sum=loss_sum, metrics=_detached(metrics))


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO's -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) per token, and where the clipped term is the smaller."""
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError("need 0 <= clip_low < 1 and clip_high >= 0")
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped.detach() < unclipped.detach()


def ppo_clip_loss(
    inputs: LossInputs, clip_low: float = 0.2, clip_high: float = 0.28, kl_coef: float = 0.0
) -> LossOutput:
    """GRPO/PPO clipped surrogate with the inference policy as the behaviour ("old") policy:
    per token -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef (r - 1 - log r)."""
    mask = inputs.loss_mask
    log_ratio = _log_ratio(inputs)
    surrogate, clip_active = _clipped_surrogate(torch.exp(log_ratio), inputs.advantages, clip_low, clip_high)
    per_token = surrogate + kl_coef * _mismatch_kl(log_ratio).to(surrogate.dtype)
    metrics = {"clipped_fraction": (mask & clip_active).sum(), **_ratio_metrics(log_ratio, mask)}
    return LossOutput(loss_sum=token_sum(per_token, mask, inputs.loss_weights), metrics=_detached(metrics))


def gspo_loss(inputs: LossInputs, clip_low: float = 3e-4, clip_high: float = 4e-4) -> LossOutput:
    """GSPO (sequence-level importance ratio), in its per-token form: every token t of sample i carries the ratio
    s_i = exp(mean over the sample's loss tokens of log p - log q), with the gradient of log p_t alone (GSPO-token
    with the sample's advantage), clipped as PPO's surrogate. With `normalize = "sequence"` (its default) the step's
    gradient is GSPO's: the mean over samples of s_i A_i grad log s_i, unclipped samples only."""
    if inputs.sample_index is None:
        raise ValueError("the gspo loss needs sample_index (which sample each token belongs to)")
    mask = inputs.loss_mask
    log_ratio = _log_ratio(inputs)
    sequence_log_ratio = sample_means(log_ratio.detach(), mask, inputs.sample_index)
    ratio = torch.exp(sequence_log_ratio + inputs.logprobs - inputs.logprobs.detach())
    surrogate, clip_active = _clipped_surrogate(ratio, inputs.advantages, clip_low, clip_high)
    metrics = {
        "clipped_fraction": (mask & clip_active).sum(),
        "sequence_ratio": (torch.exp(sequence_log_ratio) * mask).sum(),
        **_ratio_metrics(log_ratio, mask),
    }
    return LossOutput(loss_sum=token_sum(surrogate, mask, inputs.loss_weights), metrics=_detached(metrics))


def cispo_loss(inputs: LossInputs, clip_low: float = 1.0, clip_high: float = 0.28) -> LossOutput:
    """CISPO: per token -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log p. Every token keeps a gradient (the weight
    is clipped, not the update), so rare tokens whose ratio moved far still learn."""
    if not (0 <= clip_low <= 1 and clip_high >= 0):
        raise ValueError("need 0 <= clip_low <= 1 and clip_high >= 0")
    mask = inputs.loss_mask
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -weight * inputs.advantages * inputs.logprobs
    metrics = {"clipped_fraction": (mask & (weight != ratio)).sum(), **_ratio_metrics(log_ratio, mask)}
    return LossOutput(loss_sum=token_sum(per_token, mask, inputs.loss_weights), metrics=_detached(metrics))


BUILTIN_LOSSES: dict[type, Callable[..., LossOutput]] = {
    MaskedImportanceLoss: masked_importance_loss,
    PPOClipLoss: ppo_clip_loss,
    GSPOLoss: gspo_loss,
    CISPOLoss: cispo_loss,
}
_SHARED_OPTIONS = {"type", "normalize", "normalize_tokens"}  # read by the trainer, not the loss function


def build_loss(cfg: LossConfig) -> LossFn:
    """The loss function `cfg` selects, with its options bound."""
    if isinstance(cfg, CustomLoss):
        return load_loss(cfg.path, cfg.kwargs)
    options = {k: v for k, v in cfg.model_dump().items() if k not in _SHARED_OPTIONS}
    return partial(BUILTIN_LOSSES[type(cfg)], **options)


def load_loss(path: str, kwargs: dict | None = None) -> LossFn:
    """Import `module:callable` and bind `kwargs`; unknown keyword names fail here, not at the first step."""
    fn = import_object(path, "loss")
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as e:
        raise ValueError(f"loss {path!r} does not accept kwargs {sorted(kwargs)}: {e}") from None
    return partial(fn, **kwargs)
