"""Attention over packed rows for the policy (primerl.trainer.model): samples never attend across each other. The
backend gets a block-diagonal causal mask (flex / sdpa / eager) or restarting position ids (flash varlen); a segment
with a parent (a group's own tokens after a prompt laid out once) also sees its parent segment.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
from torch import Tensor

VARLEN = "varlen"  # torch.nn.attention.varlen (flash varlen kernel shipped with torch), registered with transformers
_HF_VARLEN_NAME = "primerl_varlen"


def torch_varlen_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def resolve_attention(choice: str, device: torch.device) -> str:
    """`auto` -> flash_attention_2 (flash-attn installed) or torch's varlen kernel or flex_attention on GPU; sdpa on
    CPU (flex_attention has no CPU backward)."""
    if choice == "auto":
        if device.type != "cuda":
            return "sdpa"
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        return VARLEN if torch_varlen_available() else "flex_attention"
    if choice == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("train.attention = 'flash_attention_2' but the flash-attn package is not installed")
    if choice == VARLEN and (device.type != "cuda" or not torch_varlen_available()):
        raise ValueError("train.attention = 'varlen' needs CUDA and torch.nn.attention.varlen")
    return choice


def _varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, options, **kwargs):
    """transformers attention function over packed rows: q/k/v [rows, heads, S, D] -> output [rows, S, heads, D].
    Sample boundaries come in `cu_seq_lens_q` / `max_length_q` (flattened over rows), causal inside each sample."""
    from torch.nn.attention.varlen import varlen_attn

    rows, heads, seq, dim = query.shape
    if torch.is_autocast_enabled(query.device.type):  # a custom op: autocast does not cast its inputs for it
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    q = query.transpose(1, 2).reshape(rows * seq, heads, dim)
    k = key.transpose(1, 2).reshape(rows * seq, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(rows * seq, value.shape[1], dim)
    if k.shape[1] != heads and "enable_gqa" not in options:  # older torch: repeat the key/value heads
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, **options)
    return out.view(rows, seq, heads, dim), None


def _varlen_options() -> dict:
    """Causal (and native GQA where offered) in the spelling of the installed torch's varlen_attn."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    options = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        options["enable_gqa"] = True
    return options


def varlen_boundaries(sample_index: Tensor) -> tuple[Tensor, int]:
    """Cumulative sample starts over the flattened rows (int32, with the total at the end) and the longest sample."""
    rows, seq = sample_index.shape
    starts = torch.ones_like(sample_index, dtype=torch.bool)
    starts[:, 1:] = sample_index[:, 1:] != sample_index[:, :-1]
    flat_starts = starts.view(-1).nonzero().squeeze(1)
    cu = torch.cat([flat_starts, flat_starts.new_tensor([rows * seq])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def hf_attention_name(attention: str) -> str:
    if attention != VARLEN:
        return attention
    from transformers import AttentionInterface

    AttentionInterface.register(_HF_VARLEN_NAME, functools.partial(_varlen_attention, options=_varlen_options()))
    return _HF_VARLEN_NAME


def packed_attention_mask(
    attention: str, sample_index: Tensor, dtype: torch.dtype, parent_index: Tensor | None = None
) -> object | None:
    """The mask that keeps each token's attention inside its own sample (causal), in the form `attention` wants; a
    token whose segment has a parent (`parent_index` >= 0) also sees that parent segment.

    flex_attention: a BlockMask (blocks outside every sample are skipped); sdpa: a [rows, 1, S, S] boolean mask;
    eager: the same as an additive float mask; flash_attention_2 / varlen: None (boundaries are passed otherwise).
    """
    shared = parent_index is not None and bool((parent_index >= 0).any())
    if attention in ("flash_attention_2", VARLEN):
        if shared:
            raise ValueError(
                f"train.attention = {attention!r} cannot attend across segments: batches with shared prompts "
                "(orchestrator.batch.share_prompts) need sdpa or flex_attention"
            )
        return None
    rows, seq = sample_index.shape
    if attention == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        parents = parent_index if shared else None

        def same_sample_causal(b, h, q, kv):
            visible = sample_index[b, q] == sample_index[b, kv]
            if parents is not None:
                visible = visible | ((parents[b, q] >= 0) & (parents[b, q] == sample_index[b, kv]))
            return visible & (q >= kv)

        return create_block_mask(
            same_sample_causal, rows, None, seq, seq, device=sample_index.device, _compile=sample_index.is_cuda
        )
    causal = torch.ones(seq, seq, dtype=torch.bool, device=sample_index.device).tril_()
    visible = sample_index[:, :, None] == sample_index[:, None, :]
    if shared:
        visible |= (parent_index[:, :, None] >= 0) & (parent_index[:, :, None] == sample_index[:, None, :])
    allowed = (visible & causal)[:, None]
    if attention == "sdpa":
        return allowed
    if attention == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
    raise ValueError(f"unknown attention backend {attention!r}")


def predecessor_positions(sample_index: Tensor, parent_index: Tensor | None = None) -> Tensor:
    """For each token, the position in its row of the token whose hidden state predicts it: the one before it in its
    own segment, or for the first token of a segment with a parent, the parent's last token; -1 where nothing does
    (the first token of a sample, padding)."""
    rows, seq = sample_index.shape
    positions = torch.arange(seq, device=sample_index.device).expand(rows, seq)
    previous = torch.full_like(sample_index, -1)
    continues = (sample_index[:, 1:] == sample_index[:, :-1]) & (sample_index[:, 1:] >= 0)
    previous[:, 1:] = torch.where(continues, positions[:, :-1], -1)
    if parent_index is None or not bool((parent_index >= 0).any()):
        return previous
    segments = int(sample_index.max()) + 1
    last = torch.full((rows, segments), -1, dtype=positions.dtype, device=sample_index.device)
    real = sample_index >= 0
    last.scatter_reduce_(1, sample_index.clamp(min=0), torch.where(real, positions, -1), reduce="amax")
    starts = (previous < 0) & (parent_index >= 0)
    parent_last = last.gather(1, parent_index.clamp(min=0))
    return torch.where(starts, parent_last, previous)

