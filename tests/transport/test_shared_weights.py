"""The shared-memory weight transfer (primerl.transport.shared) on the CPU: layout, round trip, confirmation."""

from __future__ import annotations

import pytest
import torch

from primerl.transport import shared, snapshots


def entries() -> list[tuple[str, tuple[int, ...]]]:
    return [("embed.weight", (33, 8)), ("norm.weight", (8,)), ("layers.0.q.weight", (8, 8))]


def test_layout_aligns_every_tensor_and_never_overlaps():
    slots, size = shared.layout(entries())
    ends = [s.offset + s.numel for s in slots]
    assert all(s.offset % 64 == 0 for s in slots)
    assert all(end <= nxt.offset for end, nxt in zip(ends, slots[1:], strict=False)) and ends[-1] <= size


def test_reader_sees_what_the_trainer_wrote_and_the_trainer_waits_for_the_confirmation(tmp_path):
    segment = shared.SharedSegment(tmp_path, entries(), torch.bfloat16, torch.device("cpu"))
    try:
        assert segment.wait_until_applied(0.0)  # nothing written yet
        values = {name: torch.randn(shape) for name, shape in entries()}
        segment.fill(values)
        path = segment.publish(3)
        assert snapshots.is_stable(path)
        assert snapshots.marker(path, snapshots.SHARED) == {"step": 3, "segment_id": segment.segment_id}
        views = shared.SharedReader(torch.device("cpu")).tensors(path, tmp_path)
        for name, value in values.items():
            assert views[name].dtype == torch.bfloat16 and torch.equal(views[name], value.to(torch.bfloat16))
        assert not segment.wait_until_applied(0.05)  # the server has not confirmed step 3
        shared.write_applied(tmp_path, 3)
        assert segment.wait_until_applied(0.05)
        values["norm.weight"] = torch.full((8,), 2.0)
        segment.fill(values)
        assert torch.equal(views["norm.weight"], torch.full((8,), 2.0, dtype=torch.bfloat16))  # the same memory
    finally:
        shm = segment.shm_path
        segment.close()
    assert shm is not None and not shm.exists()


def test_a_snapshot_of_another_segment_is_refused(tmp_path):
    old = shared.SharedSegment(tmp_path, entries(), torch.float32, torch.device("cpu"))
    old.fill({name: torch.zeros(shape) for name, shape in entries()})
    path = old.publish(1)
    new = shared.SharedSegment(tmp_path, entries(), torch.float32, torch.device("cpu"))  # e.g. a restarted trainer
    try:
        with pytest.raises(shared.SharedWeightsError, match="the trainer restarted"):
            shared.SharedReader(torch.device("cpu")).tensors(path, tmp_path)
    finally:
        old.close()
        new.close()


def test_a_buffer_left_by_a_killed_trainer_is_removed(tmp_path):
    """A trainer killed before it closed its buffer leaves the file in shared memory: the next trainer of the run
    removes it when it makes its own, and `release_shared_buffer` (what rl calls once its processes stopped) removes
    the one in use."""
    killed = shared.SharedSegment(tmp_path, entries(), torch.float32, torch.device("cpu"))  # never closed
    left = killed.shm_path
    assert left is not None and left.exists()
    restarted = shared.SharedSegment(tmp_path, entries(), torch.float32, torch.device("cpu"))
    assert not left.exists() and restarted.shm_path.exists()
    assert snapshots.release_shared_buffer(tmp_path) == restarted.shm_path and not restarted.shm_path.exists()
    assert snapshots.release_shared_buffer(tmp_path) is None
