"""Where primerl keeps what it builds once and reuses: converted models (`primerl.models`) and file-digest stamps
(`primerl.digests`), under one directory.

`cache_dir()` is `$PRIMERL_CACHE`, else `$XDG_CACHE_HOME/primerl` (an absolute path, as the XDG spec requires), else
`~/.cache/primerl`. Nothing here creates it; each user makes its own subdirectory when it first writes.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VAR = "PRIMERL_CACHE"


def cache_dir() -> Path:
    """`$PRIMERL_CACHE`, else `$XDG_CACHE_HOME/primerl` (an absolute path, as the XDG spec requires), else
    `~/.cache/primerl`."""
    if os.environ.get(CACHE_VAR):
        return Path(os.environ[CACHE_VAR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "primerl"
