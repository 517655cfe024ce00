"""Storage failures are recognised through the wrappers around them and told in one line; `atomic_write` replaces a
file whole and leaves no temp file behind."""

import errno
import os
import stat

import pytest

from primerl import storage
from primerl.storage import atomic_write, storage_failure


def test_a_full_disk_is_one_line_naming_the_file_even_when_wrapped():
    full = OSError(errno.ENOSPC, "No space left on device", "/run/checkpoints/step_3/trainer.tmp/__0_0.distcp")

    class CheckpointFailure(BaseException):  # the shape of torch's CheckpointException: per-rank (error, trace)
        def __init__(self) -> None:
            self.failures = {0: (full, None)}

    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("export failed") from e
    except RuntimeError as wrapped:
        chained = wrapped
    for error in (full, CheckpointFailure(), chained):
        line = storage_failure(error)
        assert line is not None and "\n" not in line
        assert line.startswith("no space left on the device writing /run/checkpoints/step_3/trainer.tmp/")
    assert storage_failure(OSError(errno.EROFS, "Read-only file system")).startswith("the filesystem is read-only")
    assert storage_failure(OSError(errno.ENOENT, "No such file")) is None
    assert storage_failure(ValueError("bad")) is None


def test_atomic_write_replaces_the_content_whole_and_leaves_only_the_file(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old and longer than the new content")
    assert atomic_write(path, "new") == path
    assert path.read_text() == "new"
    atomic_write(path, b"\x00bytes\xff")
    assert path.read_bytes() == b"\x00bytes\xff"
    assert os.listdir(tmp_path) == ["state.json"]


def test_atomic_write_sets_the_mode_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        secret = atomic_write(tmp_path / "token", "s3cret\n", mode=0o600)
        os.umask(0o022)
        shared = atomic_write(tmp_path / "report.json", "{}", mode=0o644)
        default = atomic_write(tmp_path / "plain.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(shared.stat().st_mode) == 0o644
    assert stat.S_IMODE(default.stat().st_mode) == 0o644  # 0666 less the umask, as any new file
    atomic_write(secret, "rotated\n", mode=0o600)  # replacing keeps it private
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.read_text() == "rotated\n"


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("kept\n")

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, "lost\n")
    assert path.read_text() == "kept\n"
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
    with pytest.raises(TypeError):
        atomic_write(tmp_path / "new.json", 3)  # type: ignore[arg-type]  # neither bytes nor str
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
