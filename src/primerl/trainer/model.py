"""The policy being trained: a Hugging Face causal LM on packed rows, with a fused, chunked log-prob head.

Contract: `Policy.forward(input_ids, position_ids, sample_index, temperature, parent_index, wanted)` takes packed
rows [rows, seq_len] (DESIGN §3.3; `sample_index` -1 on padding) and returns, per token t, the log-prob of
`input_ids[t]` given the tokens of its own sample before it, and the entropy of that next-token distribution (both 0
at the first token of a sample, and wherever `wanted` is False: only the tokens a loss reads pay for the head).
Attention never crosses samples: the backend gets a block-diagonal causal mask (flex / sdpa) or restarting position
ids (flash-attn varlen). A segment with a `parent_index` (a group's own tokens after a prompt laid out once, see
`primerl.transport.rollouts`) also sees its parent segment, and its first token is predicted from the parent's last
one; only the mask-based backends (sdpa, flex, eager) can express that. The [tokens, vocab] logits are never held in full: `fused_logprobs` works in chunks of
`chunk_tokens` rows and recomputes each chunk's logits in backward.

Precision: parameters and AdamW states stay float32 (master weights); compute runs in `compute_dtype` (bfloat16 on
GPU) through FSDP2's mixed-precision policy when sharded, through autocast otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl.config.common import ModelConfig
from primerl.config.trainer import LoraConfig, TrainingConfig
from primerl.cpu import onednn_bf16
from primerl.trainer.dist import DistInfo

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# Fused, chunked log-probs and entropy


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


# ---------------------------------------------------------------------------------------------------------------------
# Attention over packed rows


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


def _hf_attention_name(attention: str) -> str:
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


# ---------------------------------------------------------------------------------------------------------------------
# Backward matmuls in a lower precision


class _LinearCastingGrads(torch.autograd.Function):
    """F.linear whose backward runs its two matmuls in `grad_dtype` (forward, and so the log-probs, unchanged):
    the gradients autocast would give, where forward's numerics must stay those of the compute dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, grad_dtype: torch.dtype):
        ctx.save_for_backward(x, weight)
        ctx.grad_dtype = grad_dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        low = flat.to(ctx.grad_dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (low @ weight.to(ctx.grad_dtype)).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = (low.T @ x.reshape(-1, x.shape[-1]).to(ctx.grad_dtype)).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = flat.sum(0)
        return grad_x, grad_w, grad_b, None


class LinearCastingGrads(nn.Linear):
    """An nn.Linear (same parameters and state dict) whose backward matmuls run in `grad_dtype`."""

    grad_dtype: torch.dtype = torch.bfloat16

    def forward(self, x: Tensor) -> Tensor:
        return _LinearCastingGrads.apply(x, self.weight, self.bias, self.grad_dtype)


def cast_linear_grads(module: nn.Module, grad_dtype: torch.dtype) -> int:
    """Make every plain nn.Linear under `module` a LinearCastingGrads; returns how many."""
    count = 0
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = LinearCastingGrads
            child.grad_dtype = grad_dtype
            count += 1
    return count


def backward_dtype_for(choice: str, compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 for a float32 model on a CPU with bfloat16 dot products (oneDNN), the compute dtype
    otherwise."""
    if choice != "auto":
        chosen = getattr(torch, choice)
        if chosen != compute_dtype and compute_dtype != torch.float32:
            raise ValueError(f"train.backward_dtype = {choice!r} needs a float32 model; its compute dtype is "
                             f"{str(compute_dtype).removeprefix('torch.')} (model.dtype)")
        return chosen
    if device.type == "cpu" and compute_dtype == torch.float32 and onednn_bf16():
        return torch.bfloat16
    return compute_dtype


# ---------------------------------------------------------------------------------------------------------------------
# The policy module


@dataclass
class PolicyOutput:
    logprobs: Tensor  # [rows, seq], float32; 0 at the first token of each sample and where not wanted
    entropy: Tensor  # [rows, seq], float32, no gradient


class Policy(nn.Module):
    """A causal LM (optionally wrapped by peft) plus the fused log-prob head. The FSDP2 root when sharded."""

    def __init__(
        self, lm: nn.Module, attention: str, compute_dtype: torch.dtype, chunk_tokens: int,
        backward_dtype: torch.dtype | None = None, width_multiple: int = 1,
    ):
        super().__init__()
        self.lm = lm
        self.width_multiple = width_multiple  # the head's token count is rounded up to it (few shapes for oneDNN)
        self.attention = attention
        self.compute_dtype = compute_dtype
        self.backward_dtype = backward_dtype or compute_dtype
        self.chunk_tokens = chunk_tokens
        if self.backward_dtype != compute_dtype:
            cast_linear_grads(lm, self.backward_dtype)
        head = self.causal_lm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("output heads with a bias are not supported")
        if getattr(self.causal_lm.config, "final_logit_softcapping", None):
            raise ValueError("models with final logit soft-capping are not supported")

    @property
    def causal_lm(self) -> nn.Module:
        """The transformers *ForCausalLM (inside the peft wrapper when LoRA is on)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.causal_lm.get_decoder().layers

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        sample_index: Tensor,
        temperature: float = 1.0,
        parent_index: Tensor | None = None,
        wanted: Tensor | None = None,
    ) -> PolicyOutput:
        causal_lm = self.causal_lm
        mask = packed_attention_mask(self.attention, sample_index, self.compute_dtype, parent_index)
        boundaries = {}
        if self.attention == VARLEN:
            cu, longest = varlen_boundaries(sample_index)
            boundaries = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
        hidden = causal_lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False, **boundaries
        ).last_hidden_state
        previous = predecessor_positions(sample_index, parent_index)
        predicted = previous >= 0
        if wanted is not None:
            predicted &= wanted.bool()
        rows, columns = predicted.nonzero(as_tuple=True)
        count = len(rows)
        # the head sees a multiple of `width_multiple` tokens (the last one repeated, its results dropped): a CPU
        # backend caches a kernel per shape, and one per distinct count would add up over a long run
        extra = -count % self.width_multiple if count else 0
        head_rows, head_columns = (torch.cat([rows, rows[-1:].expand(extra)]),
                                   torch.cat([columns, columns[-1:].expand(extra)])) if extra else (rows, columns)
        weight = causal_lm.get_output_embeddings().weight
        logprobs, entropy = fused_logprobs(
            hidden[head_rows, previous[head_rows, head_columns]], weight, input_ids[head_rows, head_columns],
            temperature, self.chunk_tokens, self.compute_dtype, self.backward_dtype,
        )
        logprobs, entropy = logprobs[:count], entropy[:count]
        full = torch.zeros(input_ids.shape, dtype=logprobs.dtype, device=logprobs.device)
        return PolicyOutput(
            logprobs=full.index_put((rows, columns), logprobs),
            entropy=full.index_put((rows, columns), entropy),
        )

    def autocast(self, device: torch.device):
        """Autocast to the compute dtype when the parameters are float32 and FSDP does not cast them already."""
        if self.compute_dtype == torch.float32 or getattr(self, "_fsdp_casts", False):
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)


def compute_dtype_for(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def build_policy(
    model_cfg: ModelConfig, train_cfg: TrainingConfig, lora_cfg: LoraConfig, device: torch.device, dist: DistInfo
) -> tuple[Policy, object]:
    """Load the model (float32 master weights), add LoRA, checkpointing, compile, FSDP2; return (policy, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primerl.models import resolve_model

    path = resolve_model(model_cfg.name, model_cfg.revision)
    attention = resolve_attention(train_cfg.attention, device)
    compute_dtype = compute_dtype_for(model_cfg, device)
    lm = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        attn_implementation=_hf_attention_name(attention),
        trust_remote_code=model_cfg.trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    lm.config.use_cache = False
    if train_cfg.activation_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_cfg.enabled:
        lm = _add_lora(lm, lora_cfg, train_cfg.seed)
    backward_dtype = backward_dtype_for(train_cfg.backward_dtype, compute_dtype, device)
    policy = Policy(lm, attention, compute_dtype, train_cfg.logprob_chunk_tokens, backward_dtype,
                    train_cfg.width_multiple)
    policy.train()
    if train_cfg.compile:
        for layer in policy.decoder_layers:
            layer.compile()
    if dist.world_size > 1:
        shard_policy(policy, compute_dtype, device, dist.world_size)
    else:
        policy.to(device)
    return policy, tokenizer


def _add_lora(lm: nn.Module, cfg: LoraConfig, seed: int) -> nn.Module:
    import peft

    torch.manual_seed(seed)  # adapter init must match on every rank
    config = peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.target_modules, bias="none"
    )
    return peft.get_peft_model(lm, config)


def shard_policy(policy: Policy, compute_dtype: torch.dtype, device: torch.device, world_size: int) -> None:
    """FSDP2 over all `world_size` ranks on `device`'s type (the mesh is explicit, so a CPU run on a GPU host stays
    on the CPU): one unit per decoder layer, the rest (embeddings, final norm, head) in the root unit; parameters move
    to `device` as they are sharded. Gathered in `compute_dtype`, gradients reduce-scattered in float32 (averaged
    over ranks: `Trainer.step` scales the loss by the world size to make that a sum)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = policy.decoder_layers
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again at once in backward: keep them gathered
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(policy, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    policy._fsdp_casts = compute_dtype != torch.float32


def count_matmul_params(policy: Policy) -> int:
    """Parameters that take part in a matmul per token: every nn.Linear weight, including the (maybe tied) head."""
    total = 0
    for module in policy.causal_lm.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel()  # a DTensor's numel is the global one
    return total
