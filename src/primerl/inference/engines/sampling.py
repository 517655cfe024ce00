"""Batched sampling with per-row parameters and per-row random streams.

Each row samples by inverse CDF from its own uniform number, drawn on the host from the request's own
`random.Random(seed)` (one draw per sampled token). A row's token therefore depends only on its logits, its parameters
and its seed, never on which other rows share the batch, and all rows are sampled with one set of batched kernels.
The logprob returned is that of the sampled token under the distribution sampled from (see `base` for the rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from primerl.inference.engines.base import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling inputs, one entry per row, as device tensors, plus a host-side flag."""

    temperature: torch.Tensor  # float32 [n]; 0 = greedy
    top_p: torch.Tensor  # float32 [n]; 1 = off
    top_k: torch.Tensor  # int64 [n]; vocabulary size = off
    uniform: torch.Tensor  # float64 [n] in (0, 1]
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
            needs_filter=any(p.top_p < 1 for p in params) or any(k < vocab for k in top_ks),
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [n, V]. Returns (token ids int64 [n], logprobs float32 [n])."""
    tokens, token_logprobs = sample_unfiltered(logits, batch.temperature, batch.uniform)
    if not batch.needs_filter:
        return tokens, token_logprobs
    # rows that filter (and are not greedy) take the filtered sample; the others keep theirs, the same token they
    # would get in a batch where no row filters
    greedy = batch.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    logprobs = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    filtered = ((batch.top_p < 1) | (batch.top_k < logits.shape[-1])) & ~greedy
    filtered_tokens, filtered_logprobs = _sample_filtered(logprobs, batch)
    return torch.where(filtered, filtered_tokens, tokens), torch.where(filtered, filtered_logprobs, token_logprobs)


def sample_unfiltered(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-vocabulary case (top_p = 1, no top_k) with a fixed sequence of kernels and no host-side branch, so
    it can be captured in a CUDA graph together with the decode step: temperature 0 rows take the argmax (logprob
    under the untempered distribution), the others sample by inverse CDF from `uniform`.

    The inverse CDF is found in two levels, which gives the token the one-level search over the whole row's
    cumulative sum would (up to float rounding at the boundaries between tokens) in a few passes over the logits:
    the row's unnormalised probabilities are summed per block of `_BLOCK` tokens, the block holding the target is
    found from the blocks' cumulative sums, then the token inside that block. A cumulative sum along a whole row of
    a large vocabulary is one long sequential scan per row, the slowest kernel of a decode step's sampling on a GPU
    (benchmarks/NOTES.md, P3 section 11); the row's log-softmax is never written out either, only its normaliser."""
    rows, vocab = logits.shape
    greedy = temperature == 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    peak = scaled.amax(dim=-1, keepdim=True)
    blocks = -(-vocab // _BLOCK)
    # exp(scaled - peak), zero past the vocabulary (a padded copy, not `out=` into a slice: torch.compile takes no
    # non-contiguous `out=`, which a vocabulary that is not a multiple of the block would give)
    weights = F.pad(torch.exp(scaled - peak), (0, blocks * _BLOCK - vocab)).view(rows, blocks, _BLOCK)
    block_cdf = weights.sum(dim=-1).cumsum(dim=-1)  # [rows, blocks]
    total = block_cdf[:, -1:]
    target = (uniform[:, None] * total.double()).float()  # in (0, total]
    block = torch.searchsorted(block_cdf, target).clamp_(max=blocks - 1)  # [rows, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    inside = weights.gather(1, block[:, :, None].expand(rows, 1, _BLOCK)).squeeze(1)  # [rows, _BLOCK]
    offset = torch.searchsorted(inside.cumsum(dim=-1) + before, target)
    # rounding can put the target past the block's last token by a hair: take the block's last token that can occur
    last = torch.where(inside > 0, torch.arange(_BLOCK, device=inside.device), 0).amax(dim=-1, keepdim=True)
    tokens = (block * _BLOCK + torch.minimum(offset, last)).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    token_logprobs = scaled.gather(1, tokens[:, None]).squeeze(1) - peak.squeeze(1) - total.squeeze(1).log()
    return tokens, token_logprobs


_BLOCK = 256  # tokens per block of the two-level inverse CDF


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
