"""What this machine's CPU offers torch's kernels."""

from __future__ import annotations

import torch


def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bfloat16 with the CPU's bfloat16 dot products (AVX512-BF16 or AMX): where it does, a
    bfloat16 matmul runs about twice as fast as a float32 one (benchmarks/NOTES.md)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
