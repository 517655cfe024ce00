"""The RL algorithms compared on the CPU demo: `rl recipes/reverse-text.toml` (as the README runs it, without the
checklist) once per loss x advantage combination and seed, then on-policy distillation of the trained default run
into the base model.

Each run is the recipe with `--rl.trainer.loss.*` and `--rl.orchestrator.advantage.*` overrides and `--rl.seed`,
in a fresh run directory, one after the other (the machine should be otherwise quiet: the load average before and
after each run is recorded). A row per run: loss, advantage, seed, mean reward of the last 5 steps (and of the first
5), the reward per step, wall time, load averages. The distillation run is `rl @ configs/reverse-text/distill.toml`
with the first seed's run of the default combination as its teacher: the student's reward and its KL to the teacher
(`teacher_kl`, the mean over its sampled tokens of log p_student - log p_teacher) per step.

    uv run python benchmarks/algorithms.py --out benchmarks/results/algorithms_cpu.json --plot docs/algorithms_cpu.png
    uv run python benchmarks/algorithms.py --smoke     # checks the script: every combination's config resolved,
                                                       # two of them and the distillation run on the tiny model
                                                       # for 2 steps, one seed

Prints one JSON object; `--out FILE` also writes it. Runs are kept under `--work-dir` (default: a temporary
directory, removed after); started again with the same `--work-dir`, it reuses the runs that finished.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from report import add_smoke_flag, emit  # benchmarks/report.py

from primerl.monitor import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "reverse-text.toml"
DISTILL = REPO / "configs" / "reverse-text" / "distill.toml"
TINY = REPO / "configs" / "debug" / "tiny-rl.toml"
LAST = 5


@dataclass(frozen=True)
class Combination:
    loss: str
    advantage: str
    options: tuple[str, ...] = ()  # more overrides (keys under the rl stage), e.g. a normalisation
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.loss}+{self.advantage}" + (f" ({self.note})" if self.note else "")

    @property
    def slug(self) -> str:
        """The name as a directory name."""
        return re.sub(r"[^A-Za-z0-9+_]+", "-", self.name).strip("-")

    def overrides(self) -> list[str]:
        return [f"trainer.loss.type={self.loss}", f"orchestrator.advantage.type={self.advantage}", *self.options]


COMBINATIONS = [
    Combination("masked_importance", "grpo", note="the demo's default"),
    Combination("masked_importance", "dr_grpo"),
    Combination("masked_importance", "rloo"),
    Combination("masked_importance", "reinforce"),
    Combination("ppo_clip", "grpo"),
    Combination("ppo_clip", "dr_grpo", ("trainer.loss.normalize=constant", "trainer.loss.normalize_tokens=48"),
                note="Dr. GRPO"),
    Combination("gspo", "grpo"),
    Combination("cispo", "grpo"),
]


SMOKE_COMBINATIONS = 2  # the smoke run trains the first and the last combination (every one is resolved)


def check_configs(combinations: list[Combination]) -> None:
    """Resolve every run's config before anything starts (one bad key must not end an hour-long benchmark late)."""
    from primerl.config import load
    from primerl.config.rl import RLConfig
    from primerl.recipes.stages import load_recipe, validate_stage

    recipe = load_recipe(RECIPE)
    for combination in combinations:
        overrides: dict = {}
        for option in combination.overrides():
            *parents, leaf = option.split("=", 1)[0].split(".")
            node = overrides
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = option.split("=", 1)[1]
        validate_stage(recipe, "rl", overrides=overrides)
        load(RLConfig, ["@", str(TINY), *(f"--{o}" for o in combination.overrides())])
    load(RLConfig, ["@", str(DISTILL)])


def run(command: list[str], run_dir: Path) -> tuple[float, list[float], list[float]]:
    """Run `command` to the end (its console into `run_dir`.log); (wall seconds, load before, load after)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log")
    load_before = os.getloadavg()
    started = time.time()
    with log.open("w") as out:
        code = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.time() - started
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"{' '.join(command)} exited {code}:\n{tail}")
    return wall, [round(x, 2) for x in load_before], [round(x, 2) for x in os.getloadavg()]


def per_step(run_dir: Path, key: str) -> list[float | None]:
    records = sorted(read_metrics(run_dir, "orchestrator"), key=lambda r: r["step"])
    return [None if r.get(key) is None else round(float(r[key]), 5) for r in records]


def rl_command(combination: Combination, seed: int, run_dir: Path, smoke: bool) -> list[str]:
    if smoke:  # the tiny model through a plain config: the same keys without the stage prefix
        return [sys.executable, "-m", "primerl.cli", "rl", "@", str(TINY), f"--output_dir={run_dir}", "--max_steps=2",
                f"--seed={seed}", *(f"--{o}" for o in combination.overrides())]
    return [sys.executable, "-m", "primerl.cli", "rl", str(RECIPE), "--no-check", "--run-dir", str(run_dir),
            f"--rl.seed={seed}", *(f"--rl.{o}" for o in combination.overrides())]


def row(combination: Combination, seed: int, run_dir: Path, smoke: bool) -> dict:
    """One run's row; kept beside its run directory, so a benchmark started again with the same `--work-dir` reuses
    the runs that finished instead of training them again."""
    saved = run_dir.with_suffix(".row.json")
    if saved.is_file():
        return json.loads(saved.read_text())
    result = fresh_row(combination, seed, run_dir, smoke)
    saved.write_text(json.dumps(result))
    return result


def fresh_row(combination: Combination, seed: int, run_dir: Path, smoke: bool) -> dict:
    wall, before, after = run(rl_command(combination, seed, run_dir, smoke), run_dir)
    rewards = per_step(run_dir, "reward_mean")
    print(f"{combination.name} seed {seed}: last {LAST} steps {statistics.fmean(rewards[-LAST:]):.3f} in {wall:.0f}s "
          f"(load {before[0]} -> {after[0]})", file=sys.stderr, flush=True)
    return {
        "loss": combination.loss, "advantage": combination.advantage, "options": list(combination.options),
        "combination": combination.name, "seed": seed,
        "reward_last5": round(statistics.fmean(rewards[-LAST:]), 4),
        "reward_first5": round(statistics.fmean(rewards[:LAST]), 4),
        "rewards": rewards, "steps": len(rewards), "wall_s": round(wall, 1),
        "load_average_before": before, "load_average_after": after,
    }


def distillation(teacher: Path, run_dir: Path, smoke: bool) -> dict:
    """The student's reward and KL to the teacher per step, distilling `teacher` (a trained run's final weights)."""
    if smoke:
        command = [sys.executable, "-m", "primerl.cli", "rl", "@", str(TINY), f"--output_dir={run_dir}",
                   "--max_steps=2", "--orchestrator.advantage.type=distill", f"--teacher.model.name={teacher}"]
    else:
        command = [sys.executable, "-m", "primerl.cli", "rl", "@", str(DISTILL), f"--output_dir={run_dir}",
                   f"--teacher.model.name={teacher}"]
    wall, before, after = run(command, run_dir)
    return {
        "command": " ".join(["rl", *command[4:]]).replace(str(REPO) + "/", ""),
        "teacher": "the final weights of the first seed's run of the first combination",
        "reward": per_step(run_dir, "reward_mean"), "teacher_kl": per_step(run_dir, "teacher_kl"),
        "wall_s": round(wall, 1), "load_average_before": before, "load_average_after": after,
    }


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["combination"] for r in rows):
        mine = [r for r in rows if r["combination"] == name]
        last = [r["reward_last5"] for r in mine]
        out.append({"combination": name, "seeds": len(mine), "reward_last5_mean": round(statistics.fmean(last), 4),
                    "reward_last5_std": round(statistics.pstdev(last), 4) if len(last) > 1 else 0.0,
                    "wall_s_mean": round(statistics.fmean(r["wall_s"] for r in mine), 1)})
    return sorted(out, key=lambda s: -s["reward_last5_mean"])


def plot(path: Path, rows: list[dict], distilled: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["combination"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for y, name in enumerate(names):
        values = [r["reward_last5"] for r in rows if r["combination"] == name]
        left.scatter(values, [y] * len(values), color="tab:blue", alpha=0.6)
        left.plot([statistics.fmean(values)] * 2, [y - 0.3, y + 0.3], color="black")
    left.set_yticks(range(len(names)), names)
    left.invert_yaxis()
    left.set_xlabel(f"mean reward of the last {LAST} steps (dots: seeds, bar: their mean)")
    left.set_title(title)
    left.grid(axis="x", alpha=0.3)
    steps = range(1, len(distilled["reward"]) + 1)
    right.plot(steps, distilled["reward"], marker="o", color="tab:green", label="student reward")
    right.set_xlabel("step")
    right.set_ylabel("mean reward of the step's rollouts")
    twin = right.twinx()
    twin.plot(steps, distilled["teacher_kl"], marker="s", color="tab:red", label="KL to the teacher")
    twin.set_ylabel("KL(student || teacher) per sampled token")
    right.set_title("on-policy distillation into the base model")
    right.legend(handles=right.get_lines() + twin.get_lines(), loc="center right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_smoke_flag(parser)  # the tiny model, 2 steps, one seed, two combinations (all resolved) and distillation
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds of every combination (default 0 1 2; smoke: 0)")
    parser.add_argument("--only", nargs="+", help="run only these combinations (loss+advantage)")
    parser.add_argument("--work-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--plot", type=Path, help="draw the comparison and the distillation curve into this PNG")
    args = parser.parse_args(argv)

    seeds = args.seeds or ([0] if args.smoke else [0, 1, 2])
    combinations = [c for c in COMBINATIONS if not args.only or f"{c.loss}+{c.advantage}" in args.only]
    check_configs(combinations)
    if args.smoke:
        combinations = [combinations[0], *combinations[1:][-(SMOKE_COMBINATIONS - 1):]]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="primerl-algorithms-"))
    started = time.time()
    rows = [row(c, seed, work / f"{c.slug}-seed{seed}", args.smoke) for seed in seeds for c in combinations]
    teacher_run = work / f"{combinations[0].slug}-seed{seeds[0]}"
    teacher = max((teacher_run / "weights").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    distilled = distillation(teacher, work / "distill", args.smoke)
    result = {
        "benchmark": "RL algorithms on the CPU demo: " + ("the tiny model, 2 steps (smoke)" if args.smoke else
                                                          "rl recipes/reverse-text.toml --no-check per combination"),
        "command": "uv run python benchmarks/algorithms.py" + (" --smoke" if args.smoke else ""),
        "seeds": seeds,
        "summary": summary(rows),
        "rows": rows,
        "distillation": distilled,
        "wall_s": round(time.time() - started, 1),
    }
    if args.plot:
        title = "reverse-text on the CPU" + (" (smoke: tiny model, 2 steps)" if args.smoke else ", SmolLM2-135M")
        plot(args.plot, rows, distilled, title)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
