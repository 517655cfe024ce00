"""`weight_checksum`: the trainer's per-step digest of the weights is exact — equal for equal bits, different after any
change of one bit, of a name or of a dtype."""

from __future__ import annotations

import copy

import torch

from primerl.trainer.core import weight_checksum


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))


def test_equal_weights_give_equal_checksums_and_one_flipped_bit_does_not():
    a, b = model(), model()
    assert weight_checksum(a) == weight_checksum(b) and len(weight_checksum(a)) == 64
    with torch.no_grad():
        bits = b[1].bias.view(torch.int32)
        bits[0] ^= 1  # the last bit of one float32
    assert b[1].bias[0] != a[1].bias[0] and torch.isclose(b[1].bias[0], a[1].bias[0])
    assert weight_checksum(a) != weight_checksum(b)


def test_the_dtype_counts_not_only_the_values():
    a = model()
    b = copy.deepcopy(a).to(torch.float64)
    assert weight_checksum(a) != weight_checksum(b)
