"""The storage a run writes to: its failures, told in one line, and flushing what was written to it."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

STORAGE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                  errno.EROFS: "the filesystem is read-only"}


def storage_failure(error: BaseException) -> str | None:
    """One line for an error that means the run directory's storage refuses writes (full, quota, read-only), naming
    the file; None for any other error. Looks through causes and through the per-rank failures a checkpoint library
    collects (torch's CheckpointException)."""
    for cause in _causes(error):
        if isinstance(cause, OSError) and cause.errno in STORAGE_ERRNOS:
            where = f" writing {cause.filename}" if cause.filename else ""
            return (f"{STORAGE_ERRNOS[cause.errno]}{where}; free space, then continue with --resume (the last "
                    "complete checkpoint is intact)")
    return None


def _causes(error: BaseException | None, depth: int = 0) -> Iterator[BaseException]:
    if error is None or depth > 20:
        return
    yield error
    for wrapped in getattr(error, "failures", {}).values() if isinstance(getattr(error, "failures", None), dict) else ():
        yield from _causes(wrapped[0] if isinstance(wrapped, tuple) else wrapped, depth + 1)
    yield from _causes(error.__cause__ or error.__context__, depth + 1)


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename inside it), to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
