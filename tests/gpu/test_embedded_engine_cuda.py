"""The embedded engine's fast decoder on a GPU (skipped, with the reason, without CUDA: the CPU suite and CI have
none). Run on a GPU host with `python -m pytest tests/gpu/test_embedded_engine_cuda.py`.

What is checked: greedy decode through the CUDA graphs equals the uncached reference forward, one step and several
steps per call (sampling inside the graph), uncompiled and with the decode layer compiled (`inference.compile`).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled-graphs"])
def test_fast_decoder_self_check_on_cuda(compile: bool):
    from primerl.inference.engines.llama import self_check

    self_check("tiny", device="cuda", compile=compile)
