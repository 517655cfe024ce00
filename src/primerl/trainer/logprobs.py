"""Fused, chunked log-probs and entropy of the policy's output head (primerl.trainer.model): the [tokens, vocab]
logits are never held in full; `fused_logprobs` works in chunks of `chunk_tokens` rows and recomputes each chunk's
logits in backward (or keeps the softmax where it is small, on the CPU). On GPU the chunk kernels are compiled once per
bucket of rows.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _chunk_stats_keeping(logits: Tensor, targets: Tensor, inv_temp: float, acc: torch.dtype):
    """(log-prob of target, entropy, log-sum-exp, softmax [c, V]) per row of raw logits [c, V]: the softmax for a
    backward that then needs no second pass over the logits."""
    scaled = logits.to(acc) * inv_temp
    lse = torch.logsumexp(scaled, dim=-1)
    logprob = scaled.gather(1, targets[:, None]).squeeze(1) - lse
    probs = torch.exp(scaled - lse[:, None])
    entropy = lse - (probs * scaled).sum(-1)
    return logprob, entropy, lse, probs


def _chunk_stats(logits: Tensor, targets: Tensor, inv_temp: float, acc: torch.dtype):
    """(log-prob of target, entropy, log-sum-exp) per row of raw logits [c, V]; compiled, the softmax it does not
    return is never written out (fused into the entropy's sum)."""
    return _chunk_stats_keeping(logits, targets, inv_temp, acc)[:3]


def _grad_from_probs(probs: Tensor, targets: Tensor, grad: Tensor, inv_temp: float, out: torch.dtype):
    """`_chunk_grad` from kept probabilities: grad * (onehot(target) - probs) / T, written straight in `out` (one
    pass over [c, V] where a product then a cast made two)."""
    scale = grad * inv_temp
    grad_logits = torch.empty(probs.shape, dtype=out, device=probs.device)
    torch.mul(probs, -scale[:, None], out=grad_logits)
    rows = torch.arange(len(targets), device=probs.device)
    grad_logits[rows, targets] = (grad_logits[rows, targets].to(scale.dtype) + scale).to(out)
    return grad_logits


def _chunk_grad(logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor, inv_temp: float, out: torch.dtype):
    """d(sum grad * logprob)/d logits = grad * (onehot(target) - softmax) / T, in one pass over the logits."""
    probs = torch.exp(logits.to(lse.dtype) * inv_temp - lse[:, None])
    columns = torch.arange(logits.shape[1], device=logits.device)
    onehot = (columns[None, :] == targets[:, None]).to(lse.dtype)
    return ((onehot - probs) * (grad[:, None] * inv_temp)).to(out)


_compiled: dict[str, object] = {}
MIN_BUCKET_ROWS = 128
# Where the compiled kernels are not used (CPU), forward keeps the softmax of all its rows when it takes at most this
# many bytes: backward then skips recomputing the logits (a matmul as large as forward's) and the pass over them.
KEEP_PROBS_BYTES = 512 * 2**20


def _kernel(name: str, fn, device: torch.device):
    """On GPU, the element-wise passes over [chunk, vocab] are fused by torch.compile (memory-bound otherwise). The
    kernels are compiled for static shapes, so callers pad each chunk to `bucket_rows` (a handful of shapes per run)."""
    if device.type != "cuda":
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=False)
    return _compiled[name]


def bucket_rows(rows: int, chunk: int) -> int:
    """The row count a chunk of `rows` (<= `chunk`) is padded to for a compiled kernel: the next power of two from
    MIN_BUCKET_ROWS, at most `chunk`. A step's last chunk has a new length almost every step; without buckets each one
    recompiles (seconds each) until dynamo's recompile limit, then runs uncompiled."""
    return min(chunk, max(MIN_BUCKET_ROWS, 1 << (rows - 1).bit_length()))


def _chunks(n: int, chunk: int, padded: bool):
    """(start, end, rows the chunk is computed with) over n rows."""
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        yield start, end, bucket_rows(end - start, chunk) if padded else end - start


def _padded(t: Tensor, rows: int) -> Tensor:
    """`t` with zero rows appended up to `rows` along dim 0, contiguous (the compiled kernels specialise on strides
    too: an expanded gradient would compile once more)."""
    return t.contiguous() if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


class _FusedLogprobs(torch.autograd.Function):
    """log softmax(h W^T / T)[target] and the entropy of softmax(h W^T / T), `chunk` rows of h at a time.

    Forward keeps h, W, targets and the per-row log-sum-exp; backward recomputes each chunk's logits, except where
    forward kept the probabilities (uncompiled, at most KEEP_PROBS_BYTES of them). Forward's matmuls run in `dtype`,
    backward's in `grad_dtype`. The entropy is an output without gradient (a metric, not a loss term).
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float, chunk: int, dtype: torch.dtype,
        grad_dtype: torch.dtype,
    ):
        n = hidden.shape[0]
        w = weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)  # softmax statistics: float32 at least
        stats = _kernel("stats", _chunk_stats, hidden.device)
        pad = stats is not _chunk_stats
        keep = not pad and n * weight.shape[0] * acc.itemsize <= KEEP_PROBS_BYTES
        logprobs = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        probs = hidden.new_empty((n, weight.shape[0]) if keep else (0,), dtype=acc)
        for start, end, rows in _chunks(n, chunk, pad):
            logits = _padded(hidden[start:end].to(dtype), rows) @ w.T
            if keep:
                logprobs[start:end], entropy[start:end], lse[start:end], probs[start:end] = _chunk_stats_keeping(
                    logits, targets[start:end], inv_temp, acc
                )
                continue
            chunk_stats = stats(logits, _padded(targets[start:end], rows), inv_temp, acc)
            logprobs[start:end], entropy[start:end], lse[start:end] = (t[: end - start] for t in chunk_stats)
        ctx.pad, ctx.keep = pad, keep
        ctx.save_for_backward(hidden, weight, targets, lse, probs)
        ctx.inv_temp, ctx.chunk, ctx.dtype, ctx.grad_dtype = inv_temp, chunk, dtype, grad_dtype
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, _grad_entropy: Tensor):
        hidden, weight, targets, lse, probs = ctx.saved_tensors
        w = None if ctx.keep else weight.to(ctx.dtype)
        w_grad = w if w is not None and ctx.grad_dtype == ctx.dtype else weight.to(ctx.grad_dtype)
        grad_of_logits = _kernel("grad", _chunk_grad, hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = None  # the first chunk's product, then the others added to it: no [V, d] of zeros to fill
        for start, end, rows in _chunks(hidden.shape[0], ctx.chunk, ctx.pad):
            h = _padded(hidden[start:end], rows)
            g = _padded(grad_logprobs[start:end].to(lse.dtype), rows)
            if ctx.keep:
                grad_logits = _grad_from_probs(probs[start:end], targets[start:end], g, ctx.inv_temp, ctx.grad_dtype)
            else:  # the logits again, in forward's dtype (the log-sum-exp it kept is theirs)
                logits = h.to(ctx.dtype) @ w.T
                # padded rows get a zero gradient: they add nothing to grad_weight
                grad_logits = grad_of_logits(
                    logits, _padded(targets[start:end], rows), _padded(lse[start:end], rows), g, ctx.inv_temp,
                    ctx.grad_dtype,
                )
            grad_hidden[start:end] = (grad_logits @ w_grad)[: end - start]
            product = grad_logits.T @ h.to(ctx.grad_dtype)
            if grad_weight is None:
                grad_weight = product.to(lse.dtype)
            else:
                grad_weight += product
        if grad_weight is None:  # no rows
            grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def fused_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-probs of `targets` [n] and entropies under softmax(hidden [n, d] @ weight [V, d]^T / temperature).

    Forward's matmuls run in `dtype` (default: hidden's), backward's in `grad_dtype` (default: `dtype`), the softmax
    statistics and outputs in float32 (or float64)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    dtype = dtype or hidden.dtype
    return _FusedLogprobs.apply(hidden, weight, targets, 1.0 / temperature, chunk_tokens, dtype, grad_dtype or dtype)

