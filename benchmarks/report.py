"""The benchmarks' shared harness: how a script hands back its result, and its smoke mode.

`emit` prints the result as one JSON object on stdout and writes the same text to `--out` when given. It adds, under
"run", what every figure needs to be read later: the commit (PRIMERL_COMMIT, else git's HEAD, and whether the tree
had uncommitted changes), the host (cores, machine, platform, Python), the load average when the script started (the
import of this module) and at the end, torch's version and the GPU(s) when the script loaded torch and it sees one.

`--smoke` (`add_smoke_flag`): tiny sizes on the tiny model, on the CPU, in seconds, without network, so that every
script's code paths run in the default test tier (tests/benchmarks/test_smoke.py) and a rename in src/ cannot break a
benchmark unnoticed. A part that cannot run here (CUDA graphs, NCCL, vLLM, a peer's virtual environment) is named in
the result's "not_run" with the reason (`not_run`), and said on stderr, never passed over in silence. A smoke result
is marked as one and is never written under benchmarks/results/, where the measured figures live.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LOAD_AT_START = os.getloadavg()


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="check the script's code paths in seconds: tiny model and sizes, CPU, no network "
                        "(what it cannot run here is listed under not_run)")


def not_run(result: dict[str, Any], part: str, reason: str) -> None:
    """Record in `result` that `part` did not run here, and why; say so on stderr."""
    result.setdefault("not_run", {})[part] = reason
    print(f"{Path(sys.argv[0]).stem}: {part}: not run: {reason}", file=sys.stderr, flush=True)


def commit() -> dict[str, Any]:
    """The code measured: PRIMERL_COMMIT where the tree travels without .git (the GPU machine), else git's HEAD."""
    if sha := os.environ.get("PRIMERL_COMMIT"):
        return {"sha": sha, "dirty": None}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if sha else None
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def run_facts(smoke: bool) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "commit": commit(),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "platform": platform.platform(),
                 "python": platform.python_version()},
        "load_average_start": [round(x, 2) for x in LOAD_AT_START],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "smoke": smoke,
    }
    torch = sys.modules.get("torch")  # only a script that loaded torch pays for it
    if torch is not None:
        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return facts


def emit(result: dict[str, Any], out: Path | None, *, smoke: bool = False, merge_under: str | None = None,
         echo: bool = True) -> None:
    """Print `result` (with "run" added) as JSON and write it to `out`. `merge_under`: `out` holds one result per
    key and this one replaces the entry of that key. `echo=False` writes the file only (a partial result saved as a
    long benchmark goes)."""
    result = {**result, "run": run_facts(smoke)}
    text = json.dumps(result, indent=2)
    if echo:
        print(text, flush=True)
    if out is None:
        return
    if smoke and out.resolve().is_relative_to(RESULTS):
        raise SystemExit(f"{out}: a smoke run does not write under {RESULTS} (measured figures live there)")
    if merge_under is not None:
        merged = json.loads(out.read_text()) if out.is_file() else {}
        merged[merge_under] = result
        text = json.dumps(merged, indent=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
