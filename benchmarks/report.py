"""How a benchmark hands back its result: one JSON object on stdout, and the same text in `--out` when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
