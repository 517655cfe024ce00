"""Where primerl keeps what it builds once and reuses: converted models (`primerl.models`), file-digest stamps
(`primerl.digests`) and torch.compile's and Triton's caches (`use_compile_cache`), under one directory.

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


COMPILE_CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def use_compile_cache() -> dict[str, str]:
    """Point torch.compile's cache (Inductor's FX-graph and AOTAutograd entries, keyed on the graph, the torch version
    and the device) and Triton's kernel cache at `cache_dir()/compile/` where the user has not set them, before any
    process compiles: every process and every run of this user then reuses what one compiled (torch's own default is
    a directory under the system's temporary one, which a reboot or a fresh container empties). Returns what it set;
    a variable already set is left alone."""
    chosen = {}
    for var, sub in COMPILE_CACHE_VARS.items():
        if not os.environ.get(var):
            chosen[var] = os.environ[var] = str(cache_dir() / "compile" / sub)
    return chosen


def follow_cache(env: dict[str, str], cache: str) -> None:
    """A child started with its own `PRIMERL_CACHE` (in `env`) compiles into that cache: the compile-cache variables
    this process derived from its own cache directory are re-derived from `cache`; ones the user set stay."""
    for var, sub in COMPILE_CACHE_VARS.items():
        if env.get(var) == str(cache_dir() / "compile" / sub):
            env[var] = str(Path(cache).expanduser() / "compile" / sub)
