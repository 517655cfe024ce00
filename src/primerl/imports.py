"""Load a user-supplied object named `package.module:attribute` (pluggable losses, advantage functions)."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str, what: str) -> Any:
    """The object at `module:name`; ValueError naming `what` and the path when it cannot be loaded."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} path {path!r} must look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {what} {path!r}: cannot import it: {e}") from None
