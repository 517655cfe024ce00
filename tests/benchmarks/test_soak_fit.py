"""The soak's growth figures on made-up samples: a short spike (a checkpoint's buffers) tilts the least-squares line
but not the Theil-Sen slope, and a real drift shows in both; a malformed override is refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import soak
from procs import median_slope, slope


def samples(pss: list[float]) -> list[dict]:
    return [{"t": float(i), "step": i, "run_dir_mb": 1.0, "run_dir_files": 3, "load_1m": 1.0,
             "procs": {"trainer": {"pss_mb": y, "rss_mb": y, "uss_mb": y, "anon_mb": y, "fds": 4, "threads": 2}}}
            for i, y in enumerate(pss)]


def test_a_late_spike_tilts_least_squares_not_theil_sen():
    flat = [100.0] * 100
    flat[90:93] = [400.0] * 3
    assert slope(list(range(100)), flat) > 0.4  # MB per step: 40 MB per 100 steps from three samples
    assert median_slope(list(range(100)), flat) == 0.0
    got = soak.summarize("r.toml", 100, 100, 1.0, samples(flat), 0.2, "rl r.toml")["per_process"]["trainer"]
    assert got["pss_mb_per_100_steps"] > soak.TARGET_MB_PER_100_STEPS and got["pss_mb_per_100_steps_median"] == 0.0


def test_a_steady_drift_shows_in_both_fits():
    drift = [200.0 + 0.05 * i for i in range(100)]  # 5 MB per 100 steps
    got = soak.summarize("r.toml", 100, 100, 1.0, samples(drift), 0.2, "rl r.toml")
    trainer = got["per_process"]["trainer"]
    assert trainer["pss_mb_per_100_steps"] == pytest.approx(5.0) and trainer["uss_mb_per_100_steps_median"] == 5.0
    assert got["over_target"] == {"trainer": pytest.approx(5.0)}
    assert got["load_average_1m"] == {"min": 1.0, "mean": 1.0, "max": 1.0}


def test_median_slope_needs_three_points_with_spread():
    assert median_slope([1, 2], [1.0, 2.0]) is None
    assert median_slope([5, 5, 5], [1.0, 2.0, 3.0]) is None


def test_a_malformed_override_is_one_error():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "soak.py"), "--set", "no-equals-sign"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--set takes KEY=VALUE" in done.stderr and done.stdout == ""


def test_trim_cost_over_the_steps_after_the_warm_up(tmp_path: Path):
    lines = ['{"source": "orchestrator", "step": 1}', "not json"]
    for step in range(1, 11):
        record = {"source": "trainer", "step": step, "step_s": 1.0, "heap_trim_s": 0.5 if step == 1 else 0.01}
        if step in (1, 8):
            record["heap_trimmed_gb"] = 1.5
        lines.append(json.dumps(record))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(lines) + "\n")
    got = soak.trim_cost(metrics, after_step=2)
    assert (got["steps"], got["median_ms"], got["share_of_step_s_pct"], got["median_step_s"]) == (8, 10.0, 1.0, 1.0)
    assert got["fired"] == [[1, 1.5, 0.5], [8, 1.5, 0.01]]
    assert soak.trim_cost(tmp_path / "missing.jsonl", 0) is None
