"""Storage failures are recognised through the wrappers around them and told in one line."""

import errno

from primerl.storage import storage_failure


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
