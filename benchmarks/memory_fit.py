"""Memory fit: the checklist's estimate of each process's peak memory (`primerl.checklist.memory`) against the peak
measured in a real run, for several CPU configurations.

For each configuration it runs `rl RECIPE --no-check` for a few steps, samples every process of the run twice a
second (VmHWM, the kernel's high-water mark of resident memory, and PSS, benchmarks/procs.py) and reports per process
the estimated and the measured peak (resident, MB) and their `relative_error` = |estimated - measured| / measured;
the issue's target is <= 0.15 for each. The estimate is computed from the same resolved config the run used.

    uv run python benchmarks/memory_fit.py --out benchmarks/results/memory_fit.json
    uv run python benchmarks/memory_fit.py --smoke       # the tiny recipe only, 2 steps
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from procs import sample_tree  # benchmarks/procs.py
from report import add_smoke_flag, emit, not_run  # benchmarks/report.py

from primerl.checklist.memory import ModelShape, estimate_rl
from primerl.models import resolve_model
from primerl.recipes.stages import load_recipe, validate_stage

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.15
ROLE_OF_NEED = {"launcher": "rl", "inference": "inference", "orchestrator": "orchestrator", "trainer": "trainer"}
# name: (recipe, overrides of its rl stage)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("recipes/tiny.toml", {"max_steps": 6}),
    "demo": ("recipes/reverse-text.toml", {"max_steps": 6}),
    "tiny_long_rows": ("recipes/tiny.toml", {"max_steps": 6, "seq_len": 2048,
                                             "inference": {"max_model_len": 2048, "max_batch_size": 32},
                                             "orchestrator": {"sampling": {"max_tokens": 256}}}),
}


def flat(overrides: dict[str, Any], prefix: str = "rl") -> list[str]:
    out = []
    for key, value in overrides.items():
        if isinstance(value, dict):
            out.extend(flat(value, f"{prefix}.{key}"))
        else:
            out.append(f"--{prefix}.{key}={value}")
    return out


def measure(recipe: str, overrides: dict[str, Any], work: Path) -> tuple[dict[str, dict[str, float]], float]:
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "primerl.cli", "rl", recipe, "--no-check", "--run-dir", str(run_dir),
               *flat(overrides)]
    peaks: dict[str, dict[str, float]] = {}
    started = time.time()
    log_path = work / "console.log"
    with open(log_path, "w") as log, subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT) as proc:
        while proc.poll() is None:
            for role, facts in sample_tree(proc.pid).items():
                seen = peaks.setdefault(role, {"peak_rss_mb": 0.0, "peak_pss_mb": 0.0})
                seen["peak_rss_mb"] = max(seen["peak_rss_mb"], facts["hwm_mb"], facts["rss_mb"])
                seen["peak_pss_mb"] = max(seen["peak_pss_mb"], facts["pss_mb"])
            time.sleep(0.5)
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise SystemExit(f"rl {recipe} exited {proc.returncode}:\n{tail}")
    return peaks, time.time() - started


def compare(name: str, recipe_path: str, overrides: dict[str, Any], work: Path) -> dict[str, Any]:
    recipe = load_recipe(REPO / recipe_path)
    cfg = validate_stage(recipe, "rl", run_dir=work / "run", overrides=overrides)
    shape = ModelShape.read(resolve_model(cfg.model.name, cfg.model.revision))
    needs = estimate_rl(cfg, shape)
    measured, wall = measure(recipe_path, overrides, work)
    rows = []
    for need in needs:
        got = measured.get(ROLE_OF_NEED[need.role])
        if got is None:
            continue
        estimated_mb = need.host_bytes / 2**20
        rows.append({"config": name, "process": need.role, "estimated_peak_mb": round(estimated_mb, 1),
                     "measured_peak_rss_mb": round(got["peak_rss_mb"], 1),
                     "measured_peak_pss_mb": round(got["peak_pss_mb"], 1),
                     "relative_error": round(abs(estimated_mb - got["peak_rss_mb"]) / got["peak_rss_mb"], 3),
                     "parts_mb": need.as_json()["parts_mb"]})
    total_est = sum(r["estimated_peak_mb"] for r in rows)
    total_rss = sum(r["measured_peak_rss_mb"] for r in rows)
    return {"config": name, "recipe": recipe_path, "overrides": flat(overrides), "wall_s": round(wall, 1),
            "model_params": shape.params, "rows": rows,
            "total": {"estimated_mb": round(total_est, 1), "measured_peak_rss_sum_mb": round(total_rss, 1),
                      "measured_peak_pss_sum_mb": round(sum(r["measured_peak_pss_mb"] for r in rows), 1),
                      "relative_error": round(abs(total_est - total_rss) / total_rss, 3)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    configs = {"tiny": ("recipes/tiny.toml", {"max_steps": 2})} if args.smoke else \
        {name: CONFIGS[name] for name in args.configs}
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="primerl-memory-fit-"))
    results = []
    for name, (recipe, overrides) in configs.items():
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        results.append(compare(name, recipe, overrides, folder))
        print(f"{name}: " + ", ".join(f"{r['process']} est {r['estimated_peak_mb']:.0f} / measured "
                                      f"{r['measured_peak_rss_mb']:.0f} MB" for r in results[-1]["rows"]),
              file=sys.stderr, flush=True)
    rows = [r for c in results for r in c["rows"]]
    result = {
        "benchmark": "memory fit: estimated vs measured peak resident memory per process",
        "measured": "VmHWM (peak RSS) of each process, sampled every 0.5 s; PSS peak beside it",
        "target_relative_error": TARGET,
        "configs": results,
        "rows": rows,
        "within_target": sum(r["relative_error"] <= TARGET for r in rows),
        "max_relative_error": max((r["relative_error"] for r in rows), default=None),
    }
    if args.smoke:
        for part in ("demo", "tiny_long_rows"):
            not_run(result, part, "smoke: the tiny recipe only")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
