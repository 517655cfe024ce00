"""Stamped sha256: a file unchanged since it was hashed is not hashed again; any change to it is."""

from __future__ import annotations

import hashlib
import os

import pytest

from primerl import digests


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def settled(monkeypatch):
    """Treat files as settled at once (the real rule waits SETTLE_S seconds after the file's last change)."""
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)


def test_an_unchanged_file_is_answered_from_its_stamp(tmp_path, settled, monkeypatch):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights v1")
    stamps = tmp_path / "stamps"
    assert digests.sha256_stamped(weights, stamps) == digest_of(b"weights v1")
    assert len(list(stamps.iterdir())) == 1

    def no_hashing(path, chunk=0):
        raise AssertionError(f"{path} was hashed again although its stamp matches")

    monkeypatch.setattr(digests, "sha256_file", no_hashing)
    assert digests.sha256_stamped(weights, stamps) == digest_of(b"weights v1")


def test_a_rewritten_file_is_hashed_again_even_with_its_mtime_and_size_restored(tmp_path, settled):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights v1")
    stamps = tmp_path / "stamps"
    digests.sha256_stamped(weights, stamps)
    before = weights.stat()
    weights.write_bytes(b"weights v2")  # same size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back; ctime cannot be
    assert digests.sha256_stamped(weights, stamps) == digest_of(b"weights v2")


def test_a_file_changed_just_now_is_not_stamped(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"fresh")
    stamps = tmp_path / "stamps"
    assert digests.sha256_stamped(weights, stamps) == digest_of(b"fresh")
    assert not stamps.exists() or not list(stamps.iterdir())


def test_a_corrupt_stamp_is_not_trusted(tmp_path, settled):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    stamps = tmp_path / "stamps"
    digests.sha256_stamped(weights, stamps)
    (stamp,) = stamps.iterdir()
    stamp.write_text("{not json")
    assert digests.sha256_stamped(weights, stamps) == digest_of(b"weights")


def test_an_unwritable_stamp_directory_only_costs_the_hash(tmp_path, settled):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert digests.sha256_stamped(weights, blocker / "stamps") == digest_of(b"weights")
