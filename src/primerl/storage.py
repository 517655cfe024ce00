"""Failures of the storage a run writes to, told in one line."""

from __future__ import annotations

import errno

STORAGE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                  errno.EROFS: "the filesystem is read-only"}


def storage_failure(error: BaseException | None) -> str | None:
    """One line for an OSError that means the run directory's storage refuses writes (full, quota, read-only), naming
    the file; None for any other error."""
    seen = error
    while seen is not None and not (isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS):
        seen = seen.__cause__ or seen.__context__  # e.g. a checkpoint library's exception around the OSError
    if seen is None:
        return None
    error = seen
    where = f" writing {error.filename}" if error.filename else ""
    return f"{STORAGE_ERRNOS[error.errno]}{where}; free space, then continue with --resume (checkpoints stay intact)"
