"""`primerl.trainer.core.trimmed_width`: the columns a micro-batch's forward reads, rounded to `train.width_multiple`."""

import torch

from primerl.trainer.core import trimmed_width


def rows(*used_per_row, width=200):
    index = torch.full((len(used_per_row), width), -1)
    for r, used in enumerate(used_per_row):
        index[r, :used] = 0
    return index


def test_trimmed_width_rounds_up_to_the_multiple_and_never_past_the_row():
    assert trimmed_width(rows(37, 5)) == 37
    assert trimmed_width(rows(37, 5), 64) == 64
    assert trimmed_width(rows(64), 64) == 64
    assert trimmed_width(rows(65), 64) == 128
    assert trimmed_width(rows(150), 64) == 192
    assert trimmed_width(rows(193), 64) == 200  # 256 would pass the row's 200 columns
    assert trimmed_width(rows(0), 64) == 64


def test_many_widths_become_few_shapes():
    widths = {trimmed_width(rows(n, width=512), 64) for n in range(1, 513)}
    assert widths == {64, 128, 192, 256, 320, 384, 448, 512}
