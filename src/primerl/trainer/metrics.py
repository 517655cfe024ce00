"""Step metrics: model FLOPs and MFU, peak memory (records are written by `primerl.monitor`).

FLOPs of one training step (forward + backward, no recomputation counted; docs/trainer.md):
    6 * N_matmul * tokens  +  6 * layers * heads * head_dim * sum_over_samples(L_s^2)
N_matmul counts every weight that multiplies each token (all nn.Linear weights, the output head included even when tied
to the embeddings); the second term is causal attention on each sample's own length L_s (packing does not attend
across samples, so it costs no more than samples one by one). Padding tokens are not counted.
"""

from __future__ import annotations

import torch

# dense bf16 tensor-core peak per device (datasheet numbers, no sparsity), matched on the device name
PEAK_BF16_FLOPS = {
    "B200": 2.25e15,
    "H200": 989.4e12,
    "H100": 989.4e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """Peak FLOP/s used for MFU: the configured value, else the table by CUDA device name; None when unknown (CPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def step_flops(matmul_params: int, layers: int, heads: int, head_dim: int, sample_lengths: list[int]) -> float:
    tokens = sum(sample_lengths)
    attention = sum(length * length for length in sample_lengths)
    return 6.0 * matmul_params * tokens + 6.0 * layers * heads * head_dim * attention


def attention_shape(config) -> tuple[int, int, int]:
    """(layers, query heads, head_dim) of a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, head_dim


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30
