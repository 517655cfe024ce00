"""The CPU server's packed matmuls run at a bounded set of row counts (oneDNN keeps kernels for every shape it meets:
a long run's prefills of every prompt length otherwise grew the server's memory), and padding the rows changes no
result."""

from __future__ import annotations

import math
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from primerl.inference.engines.llama import LlamaDecoder
from primerl.inference.engines.llama_ops import EXACT_PACKED_ROWS, _linear, _onednn_prepacks, packed_rows

needs_onednn = pytest.mark.skipif(not _onednn_prepacks(torch.float32), reason="torch without oneDNN")


def test_packed_rows_are_few_and_waste_at_most_half():
    sizes = {packed_rows(rows) for rows in range(1, 8193)}
    # every count up to EXACT_PACKED_ROWS, then two sizes per doubling up to 8192
    assert len(sizes) <= EXACT_PACKED_ROWS + 2 * math.ceil(math.log2(8192 / EXACT_PACKED_ROWS))
    for rows in range(1, 8193):
        assert rows <= packed_rows(rows) <= max(rows, math.ceil(1.5 * rows))
    assert [packed_rows(n) for n in (1, 16, 17, 25, 33, 49, 65, 97, 129)] == [1, 16, 24, 32, 48, 64, 96, 128, 192]


@needs_onednn
@pytest.mark.parametrize("shape", [(3, 1, 40), (1, 37, 40), (2, 29, 40), (16, 40)])
def test_padded_packed_matmul_equals_the_plain_one(shape):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator)
    weight, bias = torch.randn(24, 40, generator=generator), torch.randn(24, generator=generator)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    out = _linear(x, packed, bias, True)
    assert out.shape == (*shape[:-1], 24)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


class PackedShapes(TorchDispatchMode):
    """Records the input shape of every packed matmul the real decoder runs."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.mkldnn._linear_pointwise.default:
            self.shapes.add(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@needs_onednn
def test_prefills_of_every_prompt_length_meet_few_packed_shapes(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    decoder = LlamaDecoder(model, max_rows=8, max_len=256)
    assert decoder.prepack
    recorder = PackedShapes()
    with recorder:
        for width in range(1, 121, 3):  # one or two distinct prompts of 40 widths: 80 different prompt shapes
            prompt = [1 + (width * 7 + i) % 200 for i in range(width)]
            decoder.prefill(0, [prompt] * 4)
            decoder.prefill(0, [prompt, prompt[:-1] + [3]])
    rows = {shape[0] for shape in recorder.shapes}
    assert all(len(shape) == 2 for shape in recorder.shapes)
    assert rows == {packed_rows(n) for n in rows}  # only the rounded counts
    assert len(rows) <= len({packed_rows(n) for n in range(1, 241)}) <= 26  # against 80 without the rounding


# a child process (keep_freed_memory is process-wide): the heap's free bytes after ten new weight versions, and the
# bytes of one packing of the weights
REPACK = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from primerl.cpu import heap_bytes, keep_freed_memory
assert keep_freed_memory()
from primerl.inference.engines.llama import LlamaDecoder
torch.manual_seed(0)
config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=16384, max_position_embeddings=64)
decoder = LlamaDecoder(LlamaForCausalLM(config).eval(), max_rows=4, max_len=64)
packed = sum(p.weight.numel() * 4 for layer in decoder.projections for p in layer.values()) + 16384 * 256 * 4
with torch.inference_mode():
    decoder.weights_changed()
    before = heap_bytes()[1]
    for version in range(10):
        decoder.prefill(0, [[1, 2, 3]] * (1 + version % 4))  # blocks allocated between two versions
        decoder.weights_changed()
print(heap_bytes()[1] - before, packed)
"""


@needs_onednn
@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallinfo2")
def test_new_weight_versions_repack_in_place_of_the_old_packing():
    """Each version's packing takes the place of the one before in a heap that keeps what it frees (the CPU
    server's): made while the old one lived, it went elsewhere and the freed space grew by a packing's size."""
    out = subprocess.run([sys.executable, "-c", REPACK], capture_output=True, text=True, check=True)
    grown, packed = map(int, out.stdout.split())
    assert grown < packed // 4, (grown, packed)
