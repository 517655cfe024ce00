"""The admin token of `primerl inference`: the configured one, else a fresh random one, and where a launcher finds it.

With `admin_token_file` the token in use is written there (mode 0600, temp + rename, so a reader never sees half of
it); a generated token without a file is printed once on stderr, since nobody could use the admin routes otherwise.
"""

from __future__ import annotations

import logging
import secrets
import sys

from primerl.config.inference import InferenceConfig
from primerl.storage import atomic_write

log = logging.getLogger("primerl.inference")


def resolve_admin_token(cfg: InferenceConfig) -> None:
    """Make sure `cfg.admin_token` is set: the configured one (PRIMERL_ADMIN_TOKEN), else a fresh random token.
    With `admin_token_file` the token in use is written there (mode 0600, atomically); a generated token without a
    file is printed once on stderr, since nobody could use the admin routes otherwise."""
    generated = cfg.admin_token is None
    if generated:
        cfg.admin_token = secrets.token_urlsafe(32)  # type: ignore[assignment]  # validated into a SecretStr
    token = cfg.admin_token.get_secret_value()  # type: ignore[union-attr]
    if cfg.admin_token_file is not None:
        path = cfg.admin_token_file
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, token + "\n", mode=0o600)
        log.info("admin token %s, written to %s", "generated" if generated else "from config", path)
    elif generated:
        print(f"primerl inference: admin token (set PRIMERL_ADMIN_TOKEN to choose one): {token}", file=sys.stderr)
