"""Every built-in loss, normalisation and the reference KL against float64 references written out token by token in
plain Python (no torch), on a hand-made packed micro-batch: two rows, three samples, prompt tokens and padding off
the loss mask, ratios on both sides of the clip and mask bounds. Gradients: torch.autograd.gradcheck where the loss
value is a smooth function of log p (away from the bounds), the analytic gradient where the loss defines its gradient
through a stopped weight (CISPO), both compared with the same reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from primerl.config.trainer import CISPOLoss, GSPOLoss, MaskedImportanceLoss, PPOClipLoss, TrainerConfig
from primerl.trainer.loss import (
    LossInputs,
    build_loss,
    cispo_loss,
    gspo_loss,
    masked_importance_loss,
    normalization_weights,
    ppo_clip_loss,
    sample_loss_tokens,
)
from primerl.trainer.reference import reference_kl
from primerl.trainer.rl import make_rl_loss

# Two packed rows of 7 columns. Row 0: sample 0 (prompt 2 tokens, then 3 sampled), sample 1 (prompt 1, sampled 1),
# Row 1: sample 2 (prompt 1, sampled 4), then padding (sample_index -1). log-ratios d = log p - log q per token.
SAMPLE_INDEX = [[0, 0, 0, 0, 0, 1, 1], [2, 2, 2, 2, 2, -1, -1]]
MASK = [[0, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0, 0]]
LOG_Q = [[-2.0, -1.0, -0.7, -1.3, -2.2, -0.5, -0.9], [-1.1, -0.4, -1.6, -0.8, -2.5, 0.0, 0.0]]
LOG_RATIO = [[0.0, 0.0, 0.1, -0.35, 2.4, 0.0, 0.05], [0.0, -0.02, 0.3, -0.15, -2.6, 0.0, 0.0]]
ADVANTAGE_OF_SAMPLE = {0: 0.8, 1: -1.2, 2: -0.5}


def tokens():
    """(row, col, sample, log q, d, A) of every loss token: the reference's view of the batch."""
    out = []
    for row in range(2):
        for col in range(7):
            if MASK[row][col]:
                sample = SAMPLE_INDEX[row][col]
                out.append((row, col, sample, LOG_Q[row][col], LOG_RATIO[row][col], ADVANTAGE_OF_SAMPLE[sample]))
    return out


def batch(dtype=torch.float64, weights=None):
    """LossInputs of the hand-made batch; returns (inputs, log p leaf)."""
    log_q = torch.tensor(LOG_Q, dtype=dtype)
    log_p = (log_q + torch.tensor(LOG_RATIO, dtype=dtype)).requires_grad_()
    index = torch.tensor(SAMPLE_INDEX)
    advantages = torch.tensor([[ADVANTAGE_OF_SAMPLE.get(int(i), 0.0) for i in row] for row in SAMPLE_INDEX],
                              dtype=dtype)
    inputs = LossInputs(logprobs=log_p, inference_logprobs=log_q, advantages=advantages,
                        loss_mask=torch.tensor(MASK, dtype=torch.bool), entropy=torch.zeros_like(log_q),
                        sample_index=index, loss_weights=weights)
    return inputs, log_p


def with_logprobs(inputs: LossInputs, log_p: torch.Tensor) -> LossInputs:
    return LossInputs(log_p, inputs.inference_logprobs, inputs.advantages, inputs.loss_mask, inputs.entropy,
                      inputs.sample_index, inputs.loss_weights, inputs.ref_logprobs)


def clip(x, low, high):
    return min(max(x, low), high)


def grads_of(log_p: torch.Tensor) -> dict[tuple[int, int], float]:
    return {(r, c): float(log_p.grad[r, c]) for r in range(2) for c in range(7)}


# ---------------------------------------------------------------------------------------------------------------------
# References: (loss sum, {(row, col): d loss / d log p}) in float64 Python


def ref_masked_importance(lo=0.5, hi=2.0, nlo=0.2, nhi=5.0, kl=0.1):
    loss, grad = 0.0, {}
    for row, col, _, _, d, a in tokens():
        r = math.exp(d)
        band = (lo <= r <= hi) if a >= 0 else (nlo <= r <= nhi)
        if band:
            loss += -r * a + kl * (r - 1 - d)
            grad[row, col] = -a * r + kl * (r - 1)
    return loss, grad


def ref_ppo(lo=0.2, hi=0.28, kl=0.05):
    loss, grad = 0.0, {}
    for row, col, _, _, d, a in tokens():
        r = math.exp(d)
        unclipped, clipped = r * a, clip(r, 1 - lo, 1 + hi) * a
        loss += -min(unclipped, clipped) + kl * (r - 1 - d)
        grad[row, col] = (-a * r if unclipped <= clipped else 0.0) + kl * (r - 1)
    return loss, grad


def ref_gspo(lo=0.1, hi=0.15, weight=lambda sample, length: 1.0):
    """GSPO with the sample's ratio s = exp(mean d), objective -min(s A, clip(s) A) per token (weighted)."""
    by_sample: dict[int, list[tuple[int, int, float]]] = {}
    for row, col, sample, _, d, _ in tokens():
        by_sample.setdefault(sample, []).append((row, col, d))
    loss, grad = 0.0, {}
    for sample, members in by_sample.items():
        a, n = ADVANTAGE_OF_SAMPLE[sample], len(members)
        s = math.exp(math.fsum(d for _, _, d in members) / n)
        unclipped, clipped = s * a, clip(s, 1 - lo, 1 + hi) * a
        w = weight(sample, n)
        loss += n * w * -min(unclipped, clipped)
        for row, col, _ in members:
            grad[row, col] = w * (-a * s if unclipped <= clipped else 0.0)
    return loss, grad


def ref_cispo(lo=1.0, hi=0.28):
    loss, grad = 0.0, {}
    for row, col, _, log_q, d, a in tokens():
        w = clip(math.exp(d), 1 - lo, 1 + hi)
        loss += -w * a * (log_q + d)
        grad[row, col] = -w * a
    return loss, grad


CASES = {
    "masked_importance": (lambda i: masked_importance_loss(i, 0.5, 2.0, 0.2, 5.0, kl_coef=0.1), ref_masked_importance),
    "ppo_clip": (lambda i: ppo_clip_loss(i, 0.2, 0.28, kl_coef=0.05), ref_ppo),
    "gspo": (lambda i: gspo_loss(i, 0.1, 0.15), ref_gspo),
    "cispo": (lambda i: cispo_loss(i, 1.0, 0.28), ref_cispo),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradient_match_the_float64_reference(name):
    loss_fn, reference = CASES[name]
    inputs, log_p = batch()
    out = loss_fn(inputs)
    expected_loss, expected_grad = reference()
    assert out.loss_sum.item() == pytest.approx(expected_loss, rel=1e-12, abs=1e-12)
    out.loss_sum.backward()
    got = grads_of(log_p)
    for key, value in got.items():
        assert value == pytest.approx(expected_grad.get(key, 0.0), rel=1e-12, abs=1e-12), key
    # off the loss mask (prompt, padding) nothing moves
    assert all(got[r, c] == 0.0 for r in range(2) for c in range(7) if not MASK[r][c])


def test_the_hand_made_batch_crosses_every_bound():
    # the references are only worth something if each branch is taken: masked and kept tokens of both signs,
    # clipped and unclipped ratios
    inputs, _ = batch()
    masked = masked_importance_loss(inputs, 0.5, 2.0, 0.2, 5.0).metrics
    assert masked["masked_fraction_pos"].item() == 1 and masked["masked_fraction_neg"].item() == 1
    assert 0 < ppo_clip_loss(inputs).metrics["clipped_fraction"].item() < 8
    assert 0 < cispo_loss(inputs).metrics["clipped_fraction"].item() < 8
    gspo = gspo_loss(inputs, 0.1, 0.15).metrics["clipped_fraction"].item()
    assert 0 < gspo < 8  # some samples' ratios are clipped, not all


@pytest.mark.parametrize("name", ["masked_importance", "ppo_clip", "gspo"])
def test_gradcheck_in_float64(name):
    # these losses' values are smooth functions of log p between their bounds, so the finite-difference Jacobian must
    # equal autograd's (for GSPO too: its per-token form has the gradient of its sequence-level value)
    loss_fn, _ = CASES[name]
    inputs, log_p = batch()
    assert torch.autograd.gradcheck(lambda lp: loss_fn(with_logprobs(inputs, lp)).loss_sum, (log_p.detach().clone()
                                    .requires_grad_(),), eps=1e-6, atol=1e-8)


def test_cispo_gradient_is_the_stopped_clipped_weight_times_the_advantage():
    # CISPO's loss value is -w A log p with w stopped: its gradient is -w A by definition, not the derivative of the
    # value (w depends on log p): checked against the analytic form on a finer grid of ratios across both bounds
    log_ratio = torch.linspace(-1.5, 1.5, 31, dtype=torch.float64)
    log_q = torch.full_like(log_ratio, -1.0)
    log_p = (log_q + log_ratio).requires_grad_()
    advantages = torch.linspace(-1, 1, 31, dtype=torch.float64)
    inputs = LossInputs(log_p, log_q, advantages, torch.ones(31, dtype=torch.bool), torch.zeros(31))
    cispo_loss(inputs, clip_low=0.3, clip_high=0.2).loss_sum.backward()
    expected = [-min(max(math.exp(d), 0.7), 1.2) * a for d, a in zip(log_ratio.tolist(), advantages.tolist())]
    assert log_p.grad.tolist() == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# Normalisations


def test_sample_loss_tokens_counts_each_samples_sampled_tokens():
    counts = sample_loss_tokens(torch.tensor(SAMPLE_INDEX), torch.tensor(MASK, dtype=torch.bool))
    assert counts.tolist() == [3.0, 1.0, 4.0]


@pytest.mark.parametrize("normalize", ["sequence", "constant"])
def test_weighted_token_sum_over_n_is_the_normalised_loss(normalize):
    # The trainer divides each loss sum by N (the step's loss tokens). With the weights, loss_sum / N must be
    # (1/S) sum_i (1/L_i) sum_t l_t (sequence) or (1/S) sum_i (1/C) sum_t l_t (constant, C = 10).
    index, mask = torch.tensor(SAMPLE_INDEX), torch.tensor(MASK, dtype=torch.bool)
    num_tokens, num_samples = 8.0, 3.0
    weights = normalization_weights(index, mask, num_samples, num_tokens, normalize, normalize_tokens=10)
    inputs, log_p = batch(weights=weights)
    out = ppo_clip_loss(inputs, kl_coef=0.05)
    per_sample: dict[int, list[float]] = {}
    _, grad = ref_ppo()
    for row, col, sample, _, d, a in tokens():
        r = math.exp(d)
        per_sample.setdefault(sample, []).append(-min(r * a, clip(r, 0.8, 1.28) * a) + 0.05 * (r - 1 - d))
    divisor = {s: (len(v) if normalize == "sequence" else 10) for s, v in per_sample.items()}
    expected = math.fsum(math.fsum(v) / divisor[s] for s, v in per_sample.items()) / num_samples
    assert (out.loss_sum / num_tokens).item() == pytest.approx(expected, rel=1e-12)
    (out.loss_sum / num_tokens).backward()
    for row, col, sample, *_ in tokens():
        want = grad[row, col] / divisor[sample] / num_samples
        assert log_p.grad[row, col].item() == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_gspo_with_sequence_normalisation_is_the_mean_of_the_sequence_objectives():
    index, mask = torch.tensor(SAMPLE_INDEX), torch.tensor(MASK, dtype=torch.bool)
    weights = normalization_weights(index, mask, 3.0, 8.0, "sequence")
    inputs, log_p = batch(weights=weights)
    out = gspo_loss(inputs, 0.1, 0.15)
    expected, grad = ref_gspo(0.1, 0.15, weight=lambda sample, length: 8.0 / (3.0 * length))
    assert out.loss_sum.item() == pytest.approx(expected, rel=1e-12)
    out.loss_sum.backward()
    for key, value in grads_of(log_p).items():
        assert value == pytest.approx(grad.get(key, 0.0), rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------------------------------------------------------
# The KL to the reference model


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_kl_estimators_and_their_gradients(estimator):
    d = torch.tensor([-0.7, -0.01, 0.0, 0.02, 1.3], dtype=torch.float64)
    ref = torch.full_like(d, -1.2)
    log_p = (ref + d).requires_grad_()
    kl = reference_kl(log_p, ref, estimator)
    value = {"k1": lambda x: x, "k2": lambda x: x * x / 2, "k3": lambda x: math.expm1(-x) + x}[estimator]
    slope = {"k1": lambda x: 1.0, "k2": lambda x: x, "k3": lambda x: -math.expm1(-x)}[estimator]
    assert kl.tolist() == pytest.approx([value(x) for x in d.tolist()], rel=1e-12, abs=1e-18)
    kl.sum().backward()
    assert log_p.grad.tolist() == pytest.approx([slope(x) for x in d.tolist()], rel=1e-12, abs=1e-18)
    assert torch.autograd.gradcheck(lambda lp: reference_kl(lp, ref, estimator), (log_p.detach().clone()
                                    .requires_grad_(),))


def test_the_trainer_adds_the_weighted_reference_kl_to_any_loss():
    from primerl.config.trainer import ReferenceConfig
    from primerl.trainer.model import PolicyOutput

    inputs, log_p = batch()
    ref = inputs.inference_logprobs + 0.1  # the reference differs from the sampler
    mb = {"inference_logprobs": inputs.inference_logprobs, "advantages": inputs.advantages,
          "loss_mask": inputs.loss_mask, "sample_index": inputs.sample_index, "ref_logprobs": ref}
    plain = make_rl_loss(build_loss(PPOClipLoss()))(PolicyOutput(log_p, inputs.entropy), dict(mb))
    step_loss = make_rl_loss(build_loss(PPOClipLoss()), ReferenceConfig(kl_coef=0.3, estimator="k3"))
    out = step_loss(PolicyOutput(log_p, inputs.entropy), mb)
    k3 = [math.expm1(-(lq + d - lq - 0.1)) + (d - 0.1) for *_, lq, d, _ in tokens()]
    assert (out.loss_sum - plain.loss_sum).item() == pytest.approx(0.3 * math.fsum(k3), rel=1e-10)
    assert out.metrics["ref_kl"].item() == pytest.approx(math.fsum(k3), rel=1e-10)


# ---------------------------------------------------------------------------------------------------------------------
# The default stays what it was


def test_default_loss_is_the_masked_importance_loss_bit_for_bit():
    """The default config's loss, through the new typed config, against the formula of the loss as it was before
    losses had a type (float32, as the trainer runs it): equal bit for bit, value and gradient."""
    default = TrainerConfig().loss
    assert isinstance(default, MaskedImportanceLoss) and default.normalize == "token"
    inputs, log_p = batch(torch.float32)
    out = build_loss(default)(inputs)
    out.loss_sum.backward()

    old_p = log_p.detach().clone().requires_grad_()
    delta = (old_p - inputs.inference_logprobs).clamp(-20.0, 20.0)
    log_ratio = torch.where(inputs.loss_mask, delta, torch.zeros_like(delta))
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    positive = inputs.advantages >= 0
    in_band = torch.where(positive, (r >= 0.125) & (r <= 8.0), (r >= 0.125) & (r <= 8.0))
    keep = inputs.loss_mask & in_band
    kl = torch.exp(log_ratio.double()) - 1.0 - log_ratio.double()
    per_token = -ratio * inputs.advantages + 0.0 * kl.to(ratio.dtype)
    old = torch.where(keep, per_token, torch.zeros_like(per_token)).sum()
    old.backward()
    assert torch.equal(out.loss_sum, old)
    assert torch.equal(log_p.grad, old_p.grad)


@pytest.mark.parametrize("legacy", [{"path": "primerl.trainer.loss:ppo_clip_loss", "kwargs": {"clip_low": 0.1}},
                                    {"kwargs": {"kl_coef": 0.05}}])
def test_configs_written_before_loss_types_still_load(legacy):
    cfg = TrainerConfig(loss=legacy).loss
    assert cfg.type == "custom"
    inputs, _ = batch()
    fn = ppo_clip_loss if "path" in legacy else masked_importance_loss
    assert torch.equal(build_loss(cfg)(inputs).loss_sum, fn(inputs, **legacy["kwargs"]).loss_sum)


@pytest.mark.parametrize("cfg", [MaskedImportanceLoss(kl_coef=0.1), PPOClipLoss(clip_high=0.3), GSPOLoss(),
                                 CISPOLoss(clip_high=1.0)])
def test_each_typed_config_binds_its_own_options(cfg):
    inputs, _ = batch()
    options = {k: v for k, v in cfg.model_dump().items() if k not in ("type", "normalize", "normalize_tokens")}
    fn = {"masked_importance": masked_importance_loss, "ppo_clip": ppo_clip_loss, "gspo": gspo_loss,
          "cispo": cispo_loss}[cfg.type]
    assert torch.equal(build_loss(cfg)(inputs).loss_sum, fn(inputs, **options).loss_sum)
