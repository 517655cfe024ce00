"""sha256 of large files, remembered between runs.

Hashing the embedded model's 540 MB of weights takes seconds on every `rl recipe.toml` (pin verification, then the
checklist's model step). `sha256_stamped` hashes a file once and leaves a stamp in the cache (`<cache>/digests/`):
the digest with the file's identity and change times (device, inode, size, mtime and ctime in nanoseconds). A later
call returns the stamped digest only while all of those are unchanged. Writing a file changes its ctime, which no user
can set back (`touch -d` sets mtime, not ctime), so a file that changed in any way is hashed again. A file changed in
the last `SETTLE_S` seconds is never stamped: a write within the same clock tick as the stat could otherwise go
unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from primerl.cache import cache_dir
from primerl.storage import atomic_write

SETTLE_S = 2.0


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_stamped(path: Path, stamps: Path | None = None) -> str:
    """The sha256 of `path`, from its stamp in `stamps` (default `<cache>/digests`) when the file is unchanged since
    it was stamped, else hashed (and stamped). A stamp that cannot be read or written is the same as none."""
    path = Path(path).resolve()
    if stamps is None:
        stamps = cache_dir() / "digests"
    stamp = stamps / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    before = _identity(path)
    try:
        recorded = json.loads(stamp.read_text())
        if recorded["path"] == str(path) and recorded["identity"] == before:
            return recorded["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(path)
    settled = before[-1] < time.time_ns() - SETTLE_S * 1e9
    if settled and _identity(path) == before:
        _write(stamp, {"path": str(path), "identity": before, "sha256": digest})
    return digest


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _write(stamp: Path, record: dict) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(stamp, json.dumps(record))
    except OSError:  # a read-only cache: hash again next time
        pass


def sha256_tree(root: Path) -> str:
    """The sha256 of a directory tree (a package's source): over each file's relative path and the sha256 of its bytes,
    in path order. Caches and hidden entries (`__pycache__`, `*.pyc`, names starting with a dot) are left out, so
    importing the package or an editor's files do not change it; a file added, removed, renamed or edited does."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root)
        skipped = any(part.startswith(".") or part == "__pycache__" for part in relative.parts)
        if skipped or path.suffix == ".pyc" or not path.is_file():
            continue
        digest.update(f"{relative.as_posix()}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()
