"""The RL losses against values worked out by hand on four-token examples."""

import math

import pytest
import torch

from primerl.trainer.loss import LossInputs, load_loss, masked_importance_loss, ppo_clip_loss


def make_inputs(log_ratios, advantages, mask, logq=-1.0):
    logq_t = torch.full((len(log_ratios),), logq, dtype=torch.float64)
    logp = (logq_t + torch.tensor(log_ratios, dtype=torch.float64)).requires_grad_()
    inputs = LossInputs(
        logprobs=logp,
        inference_logprobs=logq_t,
        advantages=torch.tensor(advantages, dtype=torch.float64),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        entropy=torch.zeros(len(log_ratios), dtype=torch.float64),
    )
    return inputs, logp


def test_masked_importance_loss_by_hand():
    # ratios 1, e^-1, 3, 0.1, 5; advantages +1, +1, -1, -1, +1; last token is off the loss mask
    inputs, logp = make_inputs(
        [0.0, -1.0, math.log(3.0), math.log(0.1), math.log(5.0)], [1, 1, -1, -1, 1], [1, 1, 1, 1, 0]
    )
    out = masked_importance_loss(
        inputs, pos_ratio_low=0.5, pos_ratio_high=2.0, neg_ratio_low=0.2, neg_ratio_high=5.0, kl_coef=0.1
    )
    # kept: token 0 (A>0, r=1 in [0.5, 2]) and token 2 (A<0, r=3 in [0.2, 5]);
    # masked: token 1 (A>0, r=0.37 < 0.5) and token 3 (A<0, r=0.1 < 0.2)
    kl2 = 3.0 - 1.0 - math.log(3.0)
    assert out.loss_sum.item() == pytest.approx(-1.0 + 3.0 + 0.1 * kl2)
    assert out.metrics["masked_fraction"].item() == 2
    assert out.metrics["masked_fraction_pos"].item() == 1
    assert out.metrics["masked_fraction_neg"].item() == 1
    kl_all = 0.0 + (math.exp(-1) - 1 + 1) + kl2 + (0.1 - 1 - math.log(0.1))
    assert out.metrics["mismatch_kl"].item() == pytest.approx(kl_all)
    assert out.metrics["importance_ratio"].item() == pytest.approx(1 + math.exp(-1) + 3 + 0.1)
    out.loss_sum.backward()
    # d/dlogp of (-r A + c (r - 1 - log r)) = -A r + c (r - 1); zero on masked and off-mask tokens
    expected = [-1.0, 0.0, 3.0 + 0.1 * (3.0 - 1.0), 0.0, 0.0]
    assert logp.grad.tolist() == pytest.approx(expected)


def test_masked_importance_loss_bands_are_per_sign():
    # the same ratio 3 is kept for a negative advantage and masked for a positive one
    inputs, _ = make_inputs([math.log(3.0), math.log(3.0)], [1.0, -1.0], [1, 1])
    out = masked_importance_loss(inputs, pos_ratio_high=2.0, neg_ratio_high=4.0)
    assert out.metrics["masked_fraction_pos"].item() == 1
    assert out.metrics["masked_fraction_neg"].item() == 0
    assert out.loss_sum.item() == pytest.approx(3.0)


def test_on_policy_reduces_to_reinforce():
    inputs, logp = make_inputs([0.0, 0.0, 0.0], [2.0, -0.5, 1.0], [1, 1, 1])
    out = masked_importance_loss(inputs, kl_coef=1.0)
    assert out.loss_sum.item() == pytest.approx(-(2.0 - 0.5 + 1.0))
    assert out.metrics["mismatch_kl"].item() == 0
    out.loss_sum.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, 0.5, -1.0])


def test_ppo_clip_by_hand():
    r = [1.5, 0.5, 0.5, 1.5]
    inputs, logp = make_inputs([math.log(x) for x in r], [1, 1, -1, -1], [1, 1, 1, 1])
    out = ppo_clip_loss(inputs, clip_low=0.2, clip_high=0.28)
    # per token -min(rA, clip(r, 0.8, 1.28) A): -1.28 (clipped), -0.5, +0.8 (clipped), +1.5
    assert out.loss_sum.item() == pytest.approx(-1.28 - 0.5 + 0.8 + 1.5)
    assert out.metrics["clipped_fraction"].item() == 2
    out.loss_sum.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5, 0.0, 1.5])


def test_extreme_log_ratios_stay_finite():
    inputs, logp = make_inputs([80.0, -80.0], [1.0, -1.0], [1, 1])
    out = masked_importance_loss(inputs, kl_coef=0.5)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and torch.isfinite(logp.grad).all()
    assert out.metrics["masked_fraction"].item() == 2


def test_load_loss_binds_and_checks_kwargs():
    fn = load_loss("primerl.trainer.loss:ppo_clip_loss", {"clip_low": 0.1})
    inputs, _ = make_inputs([math.log(0.5)], [1.0], [1])
    assert fn(inputs).loss_sum.item() == pytest.approx(-0.5)  # -min(0.5, clip(0.5, 0.9, 1.28)) with A = 1
    with pytest.raises(ValueError, match="does not accept"):
        load_loss("primerl.trainer.loss:ppo_clip_loss", {"nope": 1})
    with pytest.raises(ValueError, match="cannot import"):
        load_loss("primerl.trainer.loss:missing", {})
    with pytest.raises(ValueError, match="module:function"):
        load_loss("no_colon", {})


@pytest.mark.parametrize("loss_fn", [masked_importance_loss, ppo_clip_loss])
def test_mismatch_kl_is_exact_for_float32_log_probs_near_the_sampler(loss_fn):
    # The trainer's log-probs are float32. For a log-ratio d near 0, r - 1 - log r ~ d^2 / 2 is a difference of terms
    # near 1, which float32 rounds to noise: the metric must be computed in float64.
    logq = torch.full((64,), -1.5, dtype=torch.float32)
    logp = logq + torch.logspace(-4, -2, 64, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(32)
    inputs = LossInputs(logprobs=logp, inference_logprobs=logq, advantages=torch.zeros(64),
                        loss_mask=torch.ones(64, dtype=torch.bool), entropy=torch.zeros(64))
    d = (logp - logq).double()  # the float32 log-ratios the loss sees, exactly
    exact = math.fsum((torch.expm1(d) - d).tolist())
    assert loss_fn(inputs).metrics["mismatch_kl"].item() == pytest.approx(exact, rel=1e-9)
