"""`primerl reproduce` on the CPU: deterministic runs replayed bit for bit, and deliberate changes refused or flagged.

Parts (`--parts`, default all):
  tiny       `rl recipes/tiny.toml --deterministic` for K steps, then `primerl reproduce RUN --steps K`: every compared
             field of every step (batch token ids, reward, loss, grad norm, weight checksum) must be equal.
  demo       the same with the demo recipe (recipes/reverse-text.toml, SmolLM2-135M), K steps.
  pin_change the tiny run reproduced on a machine whose lock file differs by one byte (PRIMERL_LOCK_FILE pointing at
             a copy): refused at verification (exit 3); with --allow-drift replayed, the drift said.
  data_row   the tiny run reproduced with one row of the data it trains on changed (the reverse_text package copied
             with one word of data/words.txt replaced, first on PYTHONPATH, so the replay's processes import it):
             refused at verification (exit 3); with --allow-drift the first differing step is flagged.

    uv run python benchmarks/reproduce.py --out benchmarks/results/reproduce_cpu.json
    uv run python benchmarks/reproduce.py --smoke     (tiny, 1 step; the changes refused only; no demo)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from report import add_smoke_flag, emit, not_run

REPO = Path(__file__).resolve().parents[1]
PARTS = ("tiny", "demo", "pin_change", "data_row")
RECIPES = {"tiny": REPO / "recipes" / "tiny.toml", "demo": REPO / "recipes" / "reverse-text.toml"}


def primerl(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "primerl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          check=False, env={**os.environ, **(env or {})})
    return done, round(time.perf_counter() - started, 1)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def deterministic_run(recipe: Path, run_dir: Path, steps: int) -> dict[str, Any]:
    done, wall = primerl("rl", str(recipe), "--run-dir", str(run_dir), "--no-check", "--deterministic",
                         f"--rl.max_steps={steps}")
    if done.returncode != 0:
        raise SystemExit(f"reproduce.py: the run of {recipe.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {"recipe": recipe.relative_to(REPO).as_posix(), "steps": steps, "run_wall_s": wall}


def reproduce(run_dir: Path, out: Path, steps: int, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done, wall = primerl("reproduce", str(run_dir), "--steps", str(steps), "--out", str(out), *extra, env=env)
    result: dict[str, Any] = {"exit_code": done.returncode, "wall_s": wall, "last_line": last_line(done.stderr)}
    report = out / "reproduce.json"
    if report.is_file():
        data = json.loads(report.read_text())
        result.update(equal=data["equal"], exact=data["exact"], first_difference=data["first_difference"],
                      drift=data["drift"], table=done.stdout.strip().splitlines(),
                      steps=[{"step": s["step"], **s["verdicts"], "replay": s["replay"]} for s in data["steps"]])
    else:
        result["replayed"] = False
    return result


def replayed_equal(result: dict[str, Any]) -> bool:
    return result["exit_code"] == 0 and bool(result.get("equal")) and all(
        all(s[f] == "equal" for f in ("tokens", "reward", "loss", "grad_norm", "weight_checksum"))
        for s in result.get("steps", [{"tokens": None}]))


def changed_package(work: Path) -> tuple[Path, str]:
    """A copy of the reverse_text package with one row of data/words.txt replaced; (its sys.path entry, the change)."""
    import reverse_text

    source = Path(reverse_text.__file__).resolve().parent
    root = work / "changed-data"
    copy = root / "reverse_text"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    words = (copy / "data" / "words.txt").read_text().splitlines()
    before, words[0] = words[0], "zebra" if words[0] != "zebra" else "yak"
    (copy / "data" / "words.txt").write_text("\n".join(words) + "\n")
    return root, f"data/words.txt row 1: {before!r} -> {words[0]!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_smoke_flag(parser)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--steps", type=int, default=3, help="steps of each run, all replayed (smoke: 1)")
    parser.add_argument("--work-dir", type=Path, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--out", type=Path, help="write the JSON result here too")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    steps = 1 if args.smoke else args.steps
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="reproduce-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"steps": steps, "parts": {}}

    for name in ("tiny", "demo"):
        if name not in parts and not (name == "tiny" and {"pin_change", "data_row"} & set(parts)):
            continue
        if name == "demo" and args.smoke:
            not_run(result, "demo", "the smoke run stays on the tiny model (the demo loads SmolLM2-135M)")
            continue
        run_dir = work / name
        part = deterministic_run(RECIPES[name], run_dir, steps)
        part["reproduce"] = reproduce(run_dir, work / f"{name}.replay", steps)
        part["every_field_equal"] = replayed_equal(part["reproduce"])
        result["parts"][name] = part

    tiny = work / "tiny"
    if "pin_change" in parts:
        lock = work / "uv.lock"
        shutil.copy(REPO / "uv.lock", lock)
        lock.write_bytes(lock.read_bytes() + b"\n")  # one byte more: another lock file
        env = {"PRIMERL_LOCK_FILE": str(lock)}
        part = {"change": "this machine's uv.lock differs by one byte from the run's lock_sha256 pin",
                "refused": reproduce(tiny, work / "pin.refused", steps, env=env)}
        if not args.smoke:
            part["allow_drift"] = reproduce(tiny, work / "pin.allowed", steps, "--allow-drift", env=env)
        result["parts"]["pin_change"] = part
    if "data_row" in parts:
        path, change = changed_package(work)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))}
        part = {"change": change, "refused": reproduce(tiny, work / "data.refused", steps, env=env)}
        if not args.smoke:
            part["allow_drift"] = reproduce(tiny, work / "data.allowed", steps, "--allow-drift", env=env)
        result["parts"]["data_row"] = part

    result["summary"] = {
        **{f"{n}_every_field_equal": result["parts"][n]["every_field_equal"] for n in ("tiny", "demo")
           if n in result["parts"] and n in parts},
        **{f"{n}_refused_exit_code": result["parts"][n]["refused"]["exit_code"] for n in ("pin_change", "data_row")
           if n in result["parts"]},
    }
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
