"""Shared helpers of the trainer tests: fixed rollout batches and reading metrics back."""

import json
import math
from pathlib import Path

import numpy as np

from primerl.transport.rollouts import Sample, write_batch

TINY_VOCAB = 1024


def fixed_samples(step: int, num: int = 6, seed: int = 0) -> list[Sample]:
    """Deterministic samples of varied lengths; inference log-probs near the tiny model's (uniform: -log V)."""
    rng = np.random.default_rng([seed, step])
    samples = []
    for i in range(num):
        n = int(rng.integers(12, 40))
        prompt = n // 3
        ids = rng.integers(3, TINY_VOCAB, n).tolist()
        mask = [0] * prompt + [1] * (n - prompt)
        logq = (-math.log(TINY_VOCAB) + rng.normal(0, 0.3, n)).tolist()
        samples.append(Sample(ids, mask, logq, float(rng.standard_normal()), env="fixed", policy_versions=(step, step)))
    return samples


def write_fixed_batches(run_dir: Path, steps, num_ranks: int = 1, seq_len: int = 64) -> None:
    for step in steps:
        write_batch(run_dir, step, fixed_samples(step), seq_len=seq_len, num_ranks=num_ranks, temperature=1.0)


def read_metrics(run_dir: Path, source: str = "trainer") -> dict[int, dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r for r in records if r["source"] == source}
