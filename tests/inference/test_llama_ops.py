"""The CPU server's packed matmuls run at a bounded set of row counts (oneDNN keeps kernels for every shape it meets:
a long run's prefills of every prompt length otherwise grew the server's memory), and padding the rows changes no
result."""

from __future__ import annotations

import math
import weakref

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



@needs_onednn
def test_a_new_weight_version_frees_each_old_packing_before_packing_anew(tiny_model_dir, monkeypatch):
    """A server's heap keeps what it frees (`primerl.cpu.keep_freed_memory`): a packing made while the old one still
    lived went elsewhere in it at every version, and the freed old ones fragmented it. Each re-pack must find the
    packing it replaces already freed."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    decoder = LlamaDecoder(model, max_rows=4, max_len=64)
    assert decoder.prepack
    projections = [decoder.lm_head, *(p for layer in decoder.projections for p in layer.values())]
    old = {id(p): weakref.ref(p.packed) for p in projections}
    reorder = torch.ops.mkldnn._reorder_linear_weight
    alive_at_repack = []

    def recording(weight):
        owner = next(p for p in projections if p.weight is weight)
        alive_at_repack.append(old[id(owner)]() is not None)
        return reorder(weight)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", recording)
    decoder.prefill(0, [[1, 2, 3]])
    decoder.weights_changed()
    assert len(alive_at_repack) == len(projections)
    assert not any(alive_at_repack)
    out = decoder.prefill(0, [[1, 2, 3]])  # the new packings serve
    monkeypatch.undo()
    assert torch.isfinite(out).all()
