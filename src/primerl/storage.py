"""The storage a run writes to: its failures, told in one line, flushing what was written to it, and replacing a file
whole so that a reader sees the old content or the new, never half of it."""

from __future__ import annotations

import errno
import os
import secrets
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


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int | None = None) -> Path:
    """Replace the file `path` with `data` (str is written as UTF-8) so that a reader, or a crash, finds the old
    content or the new one, never a part: written to a temp file beside it, flushed to the device, renamed over `path`,
    and the rename flushed too. `mode` (e.g. 0o600) is the new file's permissions from its creation on; without it
    the process's umask decides, as for any new file. No temp file is left behind, whether the write succeeds or
    fails."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # exactly `mode`, whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path
