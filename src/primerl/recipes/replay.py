"""Replaying a finished recipe run (`primerl reproduce`): the replay's config, and the step-by-step comparison.

A run directory's manifest holds the RL stage's resolved config (with the run directory as `${run_dir}`) and the
pins. The replay is that config in a new directory, stopped after K steps; the learning-rate schedule is kept as the
run had it (a decay over the run's `max_steps` stays one). Then, for each step 1..K, both runs give:

    tokens           sha256 of the token ids of the step's batch (`rollouts/step_<n-1>`, every row)
    reward           the orchestrator's `reward_mean` of the step
    loss, grad_norm  the trainer's
    weight_checksum  the trainer's sha256 of the weights after the step (logged by deterministic runs)

A deterministic run (`rl --deterministic`) must match exactly, field for field. Another run cannot: with
`max_async_steps` >= 1 a step's rollouts may come from another policy version, and the server batches requests by
timing (matmul kernels are not bitwise batch-invariant), so its figures are compared within `TOLERANCES` and its
tokens and checksums are shown but not required to match.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from primerl.recipes.stages import RUN_DIR_VAR, expand

FIELDS = ("tokens", "reward", "loss", "grad_norm", "weight_checksum")
EXACT_FIELDS = ("tokens", "weight_checksum")  # digests: equal or not, never "close"
# Non-deterministic runs: |a - b| <= abs + rel * |a|, per field (reward is in [0, 1]; loss and grad norm scale freely).
TOLERANCES: dict[str, tuple[float, float]] = {"reward": (0.0, 0.15), "loss": (0.5, 1e-3), "grad_norm": (0.5, 1e-3)}
NOT_DETERMINISTIC = (
    "the run was not deterministic (rl --deterministic: CPU, max_async_steps = 0, one thread, one sequence at a "
    "time): its rollouts may come from other policy versions and the server's batches depend on timing, so the "
    "figures are compared within tolerances (reward +-0.15, loss and grad_norm +-50 %) and tokens and weight "
    "checksums are shown, not required to match"
)


class ReplayError(Exception):
    """A run directory that cannot be replayed as it is; the message says why."""


@dataclass(frozen=True)
class StepFigures:
    """What one run shows for one step (None: not recorded)."""

    step: int
    tokens: str | None = None
    reward: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    weight_checksum: str | None = None


@dataclass
class StepComparison:
    step: int
    original: StepFigures
    replay: StepFigures
    verdicts: dict[str, str] = field(default_factory=dict)  # field -> "equal" | "close" | "differs" | "missing"

    @property
    def first_difference(self) -> str | None:
        return next((name for name in FIELDS if self.verdicts.get(name) in ("differs", "missing")), None)


@dataclass
class Comparison:
    exact: bool  # the run was deterministic: every field must be equal
    steps: list[StepComparison]
    note: str | None = None  # why the comparison is not exact

    @property
    def first_difference(self) -> tuple[int, str] | None:
        for s in self.steps:
            if (name := s.first_difference) is not None:
                return s.step, name
        return None

    def as_json(self) -> dict[str, Any]:
        first = self.first_difference
        return {
            "exact": self.exact, "note": self.note, "equal": first is None,
            "first_difference": None if first is None else {"step": first[0], "field": first[1]},
            "steps": [{"step": s.step, "verdicts": s.verdicts, "original": asdict(s.original),
                       "replay": asdict(s.replay)} for s in self.steps],
        }

    def table(self) -> str:
        head = f"{'step':>4}  {'tokens':8}  {'reward (orig / replay)':32}  {'loss':32}  {'grad_norm':32}  checksum"
        lines = [head]
        for s in self.steps:
            cells = [f"{s.step:>4}", f"{s.verdicts.get('tokens', '-'):8}"]
            for name in ("reward", "loss", "grad_norm"):
                a, b = getattr(s.original, name), getattr(s.replay, name)
                cells.append(f"{_num(a)} / {_num(b)} {_mark(s.verdicts.get(name))}".ljust(32))
            checksum = s.replay.weight_checksum or s.original.weight_checksum
            cells.append(f"{s.verdicts.get('weight_checksum', '-')} {checksum[:12] if checksum else ''}".rstrip())
            lines.append("  ".join(cells))
        return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _mark(verdict: str | None) -> str:
    return {"equal": "=", "close": "~", "differs": "DIFFERS", "missing": "MISSING"}.get(verdict or "", "")


def compare_steps(original: list[StepFigures], replay: list[StepFigures], exact: bool) -> Comparison:
    """Each step of `original` against the replay's same step (a step the replay lacks: every field 'missing')."""
    by_step = {f.step: f for f in replay}
    steps = []
    for orig in original:
        again = by_step.get(orig.step, StepFigures(orig.step))
        steps.append(StepComparison(orig.step, orig, again, {n: _verdict(n, orig, again, exact) for n in FIELDS}))
    return Comparison(exact, steps, None if exact else NOT_DETERMINISTIC)


def _verdict(name: str, orig: StepFigures, again: StepFigures, exact: bool) -> str:
    a, b = getattr(orig, name), getattr(again, name)
    if a is None and b is None:
        return "n/a"  # recorded by neither run (a run without weight checksums)
    if a is None or b is None:
        return "missing" if exact or name not in EXACT_FIELDS else "n/a"
    if a == b:
        return "equal"
    if exact:
        return "differs"
    if name in EXACT_FIELDS:
        return "unequal"  # shown, not a failure: see NOT_DETERMINISTIC
    rel, absolute = TOLERANCES[name]
    return "close" if math.isclose(a, b, rel_tol=rel, abs_tol=absolute) else "differs"


# ---------------------------------------------------------------------------------------------------------------------
# Reading a run


def read_steps(run_dir: Path, steps: int) -> list[StepFigures]:
    """Steps 1..`steps` of a run directory, from its metrics.jsonl and its rollouts/ batches."""
    trainer: dict[int, dict[str, Any]] = {}
    orchestrator: dict[int, dict[str, Any]] = {}
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed run
        target = {"trainer": trainer, "orchestrator": orchestrator}.get(record.get("source"))
        if target is not None and isinstance(record.get("step"), int):
            target[record["step"]] = record
    out = []
    for step in range(1, steps + 1):
        t, o = trainer.get(step, {}), orchestrator.get(step, {})
        out.append(StepFigures(step, batch_tokens_sha256(run_dir / "rollouts" / f"step_{step - 1}"),
                               o.get("reward_mean"), t.get("loss"), t.get("grad_norm"), t.get("weight_checksum")))
    return out


def batch_tokens_sha256(batch_dir: Path) -> str | None:
    """sha256 of every row's token ids of a published batch (None when there is none)."""
    if not batch_dir.is_dir():
        return None
    from primerl.transport.rollouts import read_batch

    ids = read_batch(batch_dir).arrays["input_ids"]
    return hashlib.sha256(ids.astype("<i8").tobytes() + repr(ids.shape).encode()).hexdigest()


def replay_config(manifest: Mapping[str, Any], out_dir: Path, steps: int) -> dict[str, Any]:
    """The RL stage's config of a manifest, written for a replay of its first `steps` steps into `out_dir`."""
    stage = manifest.get("stages", {}).get("rl")
    if not stage or not isinstance(stage.get("config"), dict):
        raise ReplayError("the manifest has no RL stage config (reproduce replays a recipe's RL stage)")
    config = expand(json.loads(json.dumps(stage["config"])), RUN_DIR_VAR, str(out_dir))
    trained = int(config.get("max_steps", 0))
    if steps < 1 or steps > trained:
        raise ReplayError(f"--steps must be between 1 and the run's max_steps ({trained}), got {steps}")
    scheduler = config.setdefault("trainer", {}).setdefault("scheduler", {})
    if scheduler.get("kind", "constant") != "constant" and scheduler.get("decay_steps") is None:
        scheduler["decay_steps"] = max(1, trained - int(scheduler.get("warmup_steps", 0)))  # the run's schedule
    config.update(max_steps=steps, output_dir=str(out_dir), resume=False)
    return config


def is_deterministic(manifest: Mapping[str, Any]) -> bool:
    config = manifest.get("stages", {}).get("rl", {}).get("config", {})
    return bool(config.get("deterministic", False))
