"""Batched sampling with per-row parameters and per-row random streams.

Each row samples by inverse CDF from its own uniform number, drawn on the host from the request's own
`random.Random(seed)` (one draw per sampled token). A row's token therefore depends only on its logits, its parameters
and its seed, never on which other rows share the batch, and all rows are sampled with one set of batched kernels.
The logprob returned is that of the sampled token under the distribution sampled from (see `base` for the rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from primerl.inference.engines.base import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling inputs, one entry per row, as device tensors, plus two host-side flags."""

    temperature: torch.Tensor  # float32 [n]; 0 = greedy
    top_p: torch.Tensor  # float32 [n]; 1 = off
    top_k: torch.Tensor  # int64 [n]; vocabulary size = off
    uniform: torch.Tensor  # float64 [n] in (0, 1]
    any_greedy: bool
    needs_filter: bool  # any row with top_p < 1 or top_k < vocabulary size

    @classmethod
    def build(cls, params: list[SamplingParams], uniforms: list[float], vocab: int, device: torch.device):
        """Move the rows' parameters to `device` in one copy."""
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        host = torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params], top_ks, uniforms], dtype=torch.float64
        )
        rows = host.to(device, non_blocking=True)
        return cls(
            temperature=rows[0].float(),
            top_p=rows[1].float(),
            top_k=rows[2].long(),
            uniform=rows[3],
            any_greedy=any(p.temperature == 0 for p in params),
            needs_filter=any(p.top_p < 1 for p in params) or any(k < vocab for k in top_ks),
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [n, V]. Returns (token ids int64 [n], logprobs float32 [n])."""
    if not batch.needs_filter:
        return sample_unfiltered(logits, batch.temperature, batch.uniform)
    logits = logits.float()
    greedy = batch.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    logprobs = torch.log_softmax(logits / temperature[:, None], dim=-1)
    tokens, token_logprobs = _inverse_cdf(logprobs, batch.uniform)
    # rows that filter take the filtered sample; the others keep theirs
    filtered = (batch.top_p < 1) | (batch.top_k < logits.shape[-1])
    filtered_tokens, filtered_logprobs = _sample_filtered(logprobs, batch)
    tokens = torch.where(filtered, filtered_tokens, tokens)
    token_logprobs = torch.where(filtered, filtered_logprobs, token_logprobs)
    if batch.any_greedy:
        argmax = logits.argmax(dim=-1)
        tokens = torch.where(greedy, argmax, tokens)
        token_logprobs = torch.where(greedy, logprobs.gather(1, argmax[:, None]).squeeze(1), token_logprobs)
    return tokens, token_logprobs


def sample_unfiltered(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-vocabulary case (top_p = 1, no top_k) with a fixed sequence of kernels and no host-side branch, so
    it can be captured in a CUDA graph together with the decode step: temperature 0 rows take the argmax (logprob
    under the untempered distribution), the others sample by inverse CDF from `uniform`."""
    logits = logits.float()
    greedy = temperature == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    tokens, _ = _inverse_cdf(logprobs, uniform)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cdf = logprobs.exp().cumsum(dim=-1)
    target = (uniform * cdf[:, -1].double()).float()[:, None]
    tokens = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logprobs.shape[-1] - 1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _sample_filtered(logprobs: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k / top-p: keep the most likely tokens (at least one) and sample from the renormalized rest."""
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
    probs = sorted_logprobs.exp()
    mass_before = probs.cumsum(dim=-1) - probs
    rank = torch.arange(probs.shape[-1], device=probs.device)
    keep = (mass_before < batch.top_p[:, None]) & (rank[None, :] < batch.top_k[:, None])
    keep[:, 0] = True
    probs = probs * keep
    cdf = probs.cumsum(dim=-1)
    kept_mass = cdf[:, -1]
    target = (batch.uniform * kept_mass.double()).float()[:, None]
    position = torch.searchsorted(cdf, target).clamp_(max=probs.shape[-1] - 1)
    tokens = order.gather(1, position).squeeze(1)
    token_logprobs = sorted_logprobs.gather(1, position).squeeze(1) - kept_mass.log()
    return tokens, token_logprobs
