"""The policy on packed rows: log-probs of packed samples equal those computed one by one; the fused chunked head
equals the plain log-softmax in value and gradient."""

import pytest
import torch

from primerl.config.common import ModelConfig
from primerl.config.trainer import LoraConfig, TrainingConfig
from primerl.trainer.dist import DistInfo
from primerl.trainer.model import build_policy, fused_logprobs, packed_attention_mask
from primerl.transport.rollouts import Sample, pack_samples


def tiny_policy(attention="sdpa", chunk=7):
    train = TrainingConfig(attention=attention, logprob_chunk_tokens=chunk)
    policy, _ = build_policy(ModelConfig(name="tiny"), train, LoraConfig(), torch.device("cpu"), DistInfo())
    return policy


def random_samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(torch.randint(3, 1000, (n,), generator=g).tolist(), [0] + [1] * (n - 1), [0.0] * n, 1.0) for n in lengths
    ]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_equal_one_by_one(attention):
    policy = tiny_policy(attention)
    samples = random_samples([5, 17, 9, 30, 2])
    a = {k: torch.from_numpy(v).long() for k, v in pack_samples(samples, 64).arrays.items()}
    assert a["input_ids"].shape[0] == 1  # everything shares one row
    packed = policy(a["input_ids"], a["position_ids"], a["sample_index"], temperature=0.8)
    for i, s in enumerate(samples):
        ids = torch.tensor([s.input_ids])
        alone = policy(ids, torch.arange(ids.shape[1])[None], torch.zeros_like(ids), temperature=0.8)
        sel = a["sample_index"] == i
        torch.testing.assert_close(packed.logprobs[sel], alone.logprobs[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(packed.entropy[sel], alone.entropy[0], atol=2e-5, rtol=1e-5)
        assert packed.logprobs[sel][0] == 0  # a sample's first token has no prediction


def test_logprobs_match_transformers_forward():
    policy = tiny_policy()
    ids = torch.tensor([random_samples([12])[0].input_ids])
    out = policy(ids, torch.arange(12)[None], torch.zeros_like(ids))
    logits = policy.lm(input_ids=ids).logits
    ref = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs[0, 1:], ref, atol=1e-5, rtol=1e-5)


def test_block_diagonal_mask():
    index = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = packed_attention_mask("sdpa", index, torch.float32)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_fused_logprobs_value_and_gradient(chunk):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(13, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 11, (13,), generator=g)
    upstream = torch.randn(13, dtype=torch.float64, generator=g)
    lp, ent = fused_logprobs(h, w, y, temperature=0.7, chunk_tokens=chunk)
    (lp * upstream).sum().backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.log_softmax(h @ w.T / 0.7, -1)
    ref_lp = ref.gather(1, y[:, None]).squeeze(1)
    (ref_lp * upstream).sum().backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))
    torch.testing.assert_close(grads[0], h.grad)
    torch.testing.assert_close(grads[1], w.grad)
    assert not ent.requires_grad
