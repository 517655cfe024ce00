"""The policy being trained: a Hugging Face causal LM on packed rows, with a fused, chunked log-prob head.

Contract: `Policy.forward(input_ids, position_ids, sample_index, temperature, parent_index, wanted)` takes packed rows
[rows, seq_len] (docs/trainer.md, "Batches"; `sample_index` -1 on padding) and returns, per token t, the log-prob of
`input_ids[t]` given the tokens of its own sample before it, and the entropy of that next-token distribution (both 0 at
the first token of a sample, and wherever `wanted` is False: only the tokens a loss reads pay for the head). Attention
never crosses samples: the backend gets a block-diagonal causal mask (flex / sdpa) or restarting position ids
(flash-attn varlen). A segment with a `parent_index` (a group's own tokens after a prompt laid out once, see
`primerl.transport.rollouts`) also sees its parent segment, and its first token is predicted from the parent's last one;
only the mask-based backends (sdpa, flex, eager) can express that (`primerl.trainer.attention`). The [tokens, vocab]
logits are never held in full: `primerl.trainer.logprobs.fused_logprobs` works in chunks of `chunk_tokens` rows and
recomputes each chunk's logits in backward.

Precision: parameters and AdamW states stay float32 (master weights); compute runs in `compute_dtype` (bfloat16 on
GPU) through FSDP2's mixed-precision policy when sharded, through autocast otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl.config.common import ModelConfig
from primerl.config.trainer import LoraConfig, TrainingConfig
from primerl.cpu import onednn_bf16
from primerl.trainer.attention import (
    VARLEN,
    hf_attention_name,
    packed_attention_mask,
    predecessor_positions,
    resolve_attention,
    varlen_boundaries,
)
from primerl.trainer.dist import DistInfo
from primerl.trainer.logprobs import fused_logprobs

log = logging.getLogger(__name__)


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
        attn_implementation=hf_attention_name(attention),
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
