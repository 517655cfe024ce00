"""The README's first command as a user runs it: `rl recipes/reverse-text.toml` (checklist, then the recipe's RL
steps on the embedded SmolLM2-135M-Instruct), timed from launch to exit, with the reward curve it produced.

Runs the recipe in a fresh run directory (`--run-dir`, default a temporary one), reads the orchestrator's records of
metrics.jsonl (mean reward of each step's rollouts) and the checklist's report, and reports: wall time,
checklist time, time to the first trained step, the reward per step, the mean of the first and of the last three
steps and their difference, and the load average before and after (other work on the machine slows every figure;
the file says how busy it was). The checklist's time is its wall time from `<run>/checklist.json`. The model must be in the cache already (`primerl models prepare`): the download is
not part of the figure. Prints one JSON object; `--out FILE` also writes it.

    uv run python benchmarks/demo_cpu.py --out benchmarks/results/demo_reverse_text_cpu.json [--plot docs/FILE.png]
    uv run python benchmarks/demo_cpu.py --smoke --plot /tmp/smoke.png    # recipes/tiny.toml, 2 steps, no checklist
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from procs import sample_tree  # benchmarks/procs.py
from report import add_smoke_flag, emit  # benchmarks/report.py

from primerl.monitor import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "reverse-text.toml"
SMOKE = [REPO / "recipes" / "tiny.toml", "--no-check", "--rl.max_steps=2"]  # --smoke: the recipe, `rl` arguments


def rewards_per_step(run_dir: Path) -> list[float]:
    records = sorted(read_metrics(run_dir, "orchestrator"), key=lambda r: r["step"])
    return [round(float(r["reward_mean"]), 4) for r in records]


def plot_rewards(path: Path, rewards: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(rewards) + 1), rewards, marker="o")  # steps numbered from 1, as the console and metrics.jsonl
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_title("rl recipes/reverse-text.toml on 2 CPU cores")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class MemoryPeaks:
    """Samples the PSS of every process of the command's tree (checklist children included) every `every_s`
    seconds: the peak of their sum, and each role's own peak."""

    def __init__(self, root: int, every_s: float = 2.0):
        self.root, self.every_s = root, every_s
        self.total_mb, self.by_role = 0.0, {}
        self.samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            tree = sample_tree(self.root)
            if not tree:
                continue
            self.samples += 1
            self.total_mb = max(self.total_mb, sum(facts["pss_mb"] for facts in tree.values()))
            for role, facts in tree.items():
                self.by_role[role] = max(self.by_role.get(role, 0.0), facts["pss_mb"])

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def result(self) -> dict:
        return {"peak_pss_gib": round(self.total_mb / 1024, 2),
                "peak_pss_gib_by_process": {r: round(mb / 1024, 2) for r, mb in sorted(self.by_role.items())},
                "memory_samples": self.samples, "memory_sample_every_s": self.every_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--run-dir", type=Path, help="run directory (default: a fresh temporary one, removed after)")
    parser.add_argument("--plot", type=Path, help="also draw the reward per step into this PNG")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("extra", nargs="*", help="more `rl` arguments, e.g. --no-check")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.recipe, args.extra = SMOKE[0], [*SMOKE[1:], *args.extra]

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="primerl-demo-")) / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "primerl.cli", "rl", str(args.recipe), "--run-dir", str(run_dir), *args.extra]
    started = time.time()
    console = []
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        memory = MemoryPeaks(proc.pid)
        for line in proc.stdout:
            console.append((round(time.time() - started, 1), line.rstrip()))
            print(f"[{console[-1][0]:7.1f}s] {line}", end="", file=sys.stderr, flush=True)
        memory.stop()
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"rl exited {proc.returncode}; see the console above")
    rewards = rewards_per_step(run_dir)
    report = run_dir / "checklist.json"
    checklist = None
    if report.exists():  # its wall time (steps that ran together counted once); older reports: the sum of the steps
        data = json.loads(report.read_text())
        checklist = data.get("seconds") or sum(s["seconds"] for s in data["steps"])
    trained = sorted(read_metrics(run_dir, "trainer"), key=lambda r: r["step"])
    first3, last3 = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    result = {
        "benchmark": "README's first command: rl recipes/reverse-text.toml, launch to exit",
        "command": " ".join(["rl", str(args.recipe.relative_to(REPO)) if args.recipe.is_relative_to(REPO) else
                             str(args.recipe), *args.extra]),
        "wall_s": round(wall, 1),
        "checklist_s": round(checklist, 1) if checklist is not None else None,
        "first_step_s": round(trained[0]["time"] - started, 1) if trained else None,
        "steps": len(rewards),
        "rewards": rewards,
        "first3_mean": round(first3, 4),
        "last3_mean": round(last3, 4),
        "gain": round(last3 - first3, 4),
        **memory.result(),
    }
    if args.plot:
        plot_rewards(args.plot, rewards)
    if args.run_dir is None:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
