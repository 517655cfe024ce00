"""Export of `weights/step_<k>/` for inference: the full state dict gathered on rank 0, LoRA merged, written as a
Hugging Face model directory and published atomically with the `STABLE` marker last (primerl.transport.weights)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from primerl.trainer.dist import DistInfo
from primerl.trainer.model import Policy
from primerl.transport import weights as transport

POLICY_PREFIX = "lm."
PEFT_PREFIX = "base_model.model."


def full_state_dict(policy: Policy, dist: DistInfo) -> dict[str, Tensor] | None:
    """Every parameter and buffer of the language model, unsharded, on CPU, on rank 0 (None on other ranks).
    Collective: all ranks must call it."""
    if dist.world_size == 1:
        state = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not dist.is_main:
            return None
    return {k.removeprefix(POLICY_PREFIX): v for k, v in state.items()}


def merge_lora(state: dict[str, Tensor], scale: float, adapter: str = "default") -> dict[str, Tensor]:
    """Fold peft adapters into their base weights (W + scale * B A) and restore the plain transformers names."""
    merged: dict[str, Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        name = key.removeprefix(PEFT_PREFIX)
        if ".base_layer." in name:
            module = key.split(".base_layer.")[0]
            name = name.replace(".base_layer.", ".")
            if name.endswith(".weight"):
                a = state[f"{module}.lora_A.{adapter}.weight"].float()
                b = state[f"{module}.lora_B.{adapter}.weight"].float()
                value = (value.float() + scale * (b @ a)).to(value.dtype)
        merged[name] = value
    return merged


def export_weights(
    policy: Policy, tokenizer, run_dir: str | Path, step: int, dtype: torch.dtype, dist: DistInfo
) -> Path | None:
    """Write and publish `weights/step_<step>/` (rank 0 writes; returns its path there, None elsewhere)."""
    state = full_state_dict(policy, dist)
    if state is None:
        return None
    lm = policy.lm
    if hasattr(lm, "peft_config"):
        lora = lm.peft_config["default"]
        state = merge_lora(state, lora.lora_alpha / lora.r)
    config = policy.causal_lm.config
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # one tensor on disk; transformers re-ties on load
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    staged = transport.staging_dir(run_dir, step)
    save_file(state, str(staged / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
    config_dict = config.to_dict()
    config_dict["dtype"] = str(dtype).removeprefix("torch.")
    config_dict["use_cache"] = True
    (staged / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    generation_config = getattr(policy.causal_lm, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    return transport.publish(staged, run_dir, step)
