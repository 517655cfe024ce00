"""The engine's graph-capturable sampler (`sampling.sample_unfiltered`): the token it picks for a row's uniform is the
inverse CDF's of the tempered distribution, checked against a float64 computation of the same distribution."""

from __future__ import annotations

import pytest
import torch

from primerl.inference.engines.sampling import _BLOCK, sample_unfiltered


def float64_reference(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log-softmax of each row in float64, at temperature 1 for greedy rows (temperature 0)."""
    scale = torch.where(temperature == 0, 1.0, temperature).double()
    return torch.log_softmax(logits.double() / scale[:, None], dim=-1)


@pytest.mark.parametrize("vocab", [3, _BLOCK - 1, _BLOCK, _BLOCK + 1, 5000, 49152])
def test_the_sampled_token_is_the_inverse_cdf_of_its_uniform(vocab):
    torch.manual_seed(vocab)
    rows = 48
    logits = (torch.randn(rows, vocab) * torch.rand(rows, 1) * 12).bfloat16()
    temperature = torch.rand(rows) * 1.5 + 0.05
    temperature[:4] = 0  # greedy rows
    uniform = 1.0 - torch.rand(rows, dtype=torch.float64)
    uniform[4] = 1.0  # the very end of the distribution
    tokens, logprobs = sample_unfiltered(logits, temperature, uniform)
    assert tokens.dtype == torch.long and tokens.shape == (rows,) and logprobs.shape == (rows,)
    reference = float64_reference(logits, temperature)
    cdf = reference.exp().cumsum(dim=-1)
    for row in range(rows):
        token = int(tokens[row])
        assert 0 <= token < vocab
        if temperature[row] == 0:
            assert token == int(logits[row].float().argmax())
        else:
            assert reference[row, token] > -torch.inf, "a token that cannot occur was sampled"
            low = float(cdf[row, token - 1]) if token else 0.0
            target = float(uniform[row]) * float(cdf[row, -1])
            # float32 sums: the target may sit within rounding of the interval's ends, never further
            assert low - 1e-5 <= target <= float(cdf[row, token]) + 1e-5, (row, token, low, target)
        assert float(logprobs[row]) == pytest.approx(float(reference[row, token]), abs=2e-5)


def test_tokens_of_zero_probability_are_never_sampled():
    """One token holds all the mass in float32 (the others underflow to zero): every uniform, 1.0 included, takes it,
    and so do rows whose vocabulary ends inside a block."""
    vocab = 3 * _BLOCK + 7
    rows = 6
    logits = torch.full((rows, vocab), -1000.0)
    winners = torch.tensor([0, 1, _BLOCK - 1, _BLOCK, 2 * _BLOCK + 3, vocab - 1])
    logits[torch.arange(rows), winners] = 0.0
    for value in (1e-12, 0.5, 1.0):
        uniform = torch.full((rows,), value, dtype=torch.float64)
        tokens, logprobs = sample_unfiltered(logits, torch.ones(rows), uniform)
        assert tokens.tolist() == winners.tolist()
        assert logprobs.abs().max() < 1e-6


def test_a_rows_token_does_not_depend_on_the_other_rows():
    torch.manual_seed(1)
    logits = torch.randn(8, 1000) * 3
    temperature = torch.full((8,), 0.9)
    uniform = 1.0 - torch.rand(8, dtype=torch.float64)
    together, _ = sample_unfiltered(logits, temperature, uniform)
    alone = [int(sample_unfiltered(logits[i : i + 1], temperature[i : i + 1], uniform[i : i + 1])[0]) for i in range(8)]
    assert together.tolist() == alone


def test_rows_that_do_not_filter_sample_the_same_beside_rows_that_do():
    """A batch where some rows use top-p / top-k goes through the general sampler; its other rows (greedy ones
    included) must get the tokens and logprobs the capturable sampler gives them in a batch where no row filters."""
    from primerl.inference.engines.base import SamplingParams
    from primerl.inference.engines.sampling import SamplingBatch, sample

    torch.manual_seed(2)
    vocab = 3000
    logits = torch.randn(6, vocab) * 4
    plain = [SamplingParams(max_tokens=8, temperature=t) for t in (0.7, 0.0, 1.3)]
    filtering = [SamplingParams(max_tokens=8, temperature=0.7, top_p=0.5), SamplingParams(max_tokens=8, temperature=1.0, top_k=5),
                 SamplingParams(max_tokens=8, temperature=0.0, top_p=0.3)]
    uniforms = (1.0 - torch.rand(6, dtype=torch.float64)).tolist()
    mixed = SamplingBatch.build([*plain, *filtering], uniforms, vocab, torch.device("cpu"))
    assert mixed.needs_filter
    tokens, logprobs = sample(logits, mixed)
    alone_tokens, alone_logprobs = sample_unfiltered(logits[:3], mixed.temperature[:3], mixed.uniform[:3])
    assert tokens[:3].tolist() == alone_tokens.tolist()
    assert torch.equal(logprobs[:3], alone_logprobs)
    # the greedy row that asks for top-p still takes the argmax; top-k 5 keeps the token among the 5 most likely
    assert int(tokens[5]) == int(logits[5].argmax())
    assert int(tokens[4]) in logits[4].topk(5).indices.tolist()
    # the filtered rows' logprobs are those of the renormalised kept set
    kept = logits[4].topk(5).values
    expected = logits[4, tokens[4]] - torch.logsumexp(kept, dim=0)
    assert float(logprobs[4]) == pytest.approx(float(expected), abs=1e-5)


@pytest.mark.parametrize("vocab", [1000, 4 * _BLOCK])
def test_the_sampler_compiles_whole(vocab):
    """The CUDA decoder compiles the sampler into its graphs with `fullgraph=True`: dynamo must trace it without a
    break for any vocabulary size (one that is not a multiple of the block once failed: a non-contiguous `out=`),
    and the traced program samples what the eager one does. Traced with dynamo's eager backend (no code generated)."""
    torch.manual_seed(3)
    logits = torch.randn(5, vocab) * 3
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.5, 0.8])
    uniform = 1.0 - torch.rand(5, dtype=torch.float64)
    traced = torch.compile(sample_unfiltered, backend="eager", fullgraph=True, dynamic=False)
    tokens, logprobs = traced(logits, temperature, uniform)
    expected_tokens, expected_logprobs = sample_unfiltered(logits, temperature, uniform)
    assert tokens.tolist() == expected_tokens.tolist()
    torch.testing.assert_close(logprobs, expected_logprobs)
