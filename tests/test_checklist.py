"""`primerl check`: every step ends passed, failed or skipped-with-a-reason; a step that cannot run here is skipped,
never passed; a failing step makes the command exit non-zero naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny.toml"
HEAVY_STEPS = "sft_trainer,rl_trainer,inference,rl_smoke"


def check(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primerl.cli", "check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, check=False)


def statuses(report: Path) -> dict[str, tuple[str, str]]:
    return {s["name"]: (s["status"], s["detail"]) for s in json.loads(report.read_text())["steps"]}


def no_gpu_here() -> bool:
    import torch

    return not torch.cuda.is_available()


pytestmark = pytest.mark.skipif(not no_gpu_here(), reason="these tests describe a machine without GPUs")


def test_light_steps_pass_for_the_tiny_recipe_and_gpu_steps_are_skipped(tmp_path):
    report = tmp_path / "report.json"
    proc = check(str(TINY_RECIPE), "--skip", HEAVY_STEPS, "--run-dir", str(tmp_path / "run"), "--report", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = statuses(report)
    assert found.pop("flash_attn")[0] == "skipped"
    assert {name: status for name, (status, _) in found.items()} == {
        "python": "passed", "torch": "passed", "disk": "passed", "memory": "passed", "ports": "passed",
        "run_dir": "passed", "model": "passed", "memory_fit": "passed", "environment": "passed",
    }
    assert found["environment"][1].startswith("reverse-text: loaded; first task reverse-text-0-0"), found
    assert "step" in proc.stdout and "status" in proc.stdout  # the console table


def test_an_environment_setting_it_refuses_fails_the_environment_step_in_one_line(tmp_path):
    recipe = tmp_path / "tiny.toml"
    text = TINY_RECIPE.read_text()
    assert text.count('id = "reverse-text"\n') == 1
    recipe.write_text(text.replace('id = "reverse-text"\n', 'id = "reverse-text"\nargs = {reverse = "letters"}\n'))
    report = tmp_path / "report.json"
    proc = check(str(recipe), "--only", "environment", "--run-dir", str(tmp_path / "run"), "--report", str(report))
    assert proc.returncode == 1 and "environment" in proc.stderr.splitlines()[-1]
    status, detail = statuses(report)["environment"]
    assert status == "failed"
    assert detail == ("[rl.orchestrator.env] environment 'reverse-text': env.args.reverse: Input should be 'chars' or "
                      "'words' (got 'letters')")


def test_steps_a_gpu_recipe_cannot_run_here_are_skipped_with_the_reason(tmp_path):
    report = tmp_path / "report.json"
    proc = check(str(ROOT / "recipes" / "alphabet-sort.toml"), "--only", "torch,flash_attn," + HEAVY_STEPS,
                 "--run-dir", str(tmp_path / "run"), "--report", str(report))
    found = statuses(report)
    assert found["torch"][0] == "failed" and "needs 2 GPU(s)" in found["torch"][1]
    for name in ("flash_attn", *HEAVY_STEPS.split(",")):
        status, reason = found[name]
        assert status == "skipped" and ("GPU" in reason), (name, reason)
    assert proc.returncode == 1 and "torch" in proc.stderr


def test_an_unwritable_run_dir_fails_the_check_naming_the_step(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    report = tmp_path / "report.json"
    proc = check(str(TINY_RECIPE), "--only", "python,run_dir", "--run-dir", str(blocker / "run"),
                 "--report", str(report))
    assert proc.returncode == 1
    assert "run_dir" in proc.stderr.splitlines()[-1]
    assert statuses(report)["run_dir"][0] == "failed"
    assert statuses(report)["python"][0] == "passed"


def test_tampered_model_weights_fail_the_model_step(tmp_path, tiny_model_dir):
    cache = tmp_path / "cache" / "models" / tiny_model_dir.name
    shutil.copytree(tiny_model_dir, cache)
    weights = cache / "model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    report = tmp_path / "report.json"
    proc = check(str(TINY_RECIPE), "--only", "model", "--run-dir", str(tmp_path / "run"), "--report", str(report),
                 env={"PRIMERL_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    status, detail = statuses(report)["model"]
    assert status == "failed" and "model file model.safetensors: pinned" in detail


def test_check_leaves_nothing_in_the_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = check(str(TINY_RECIPE), "--only", "python", "--run-dir", str(tmp_path / "run"), env={"TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(tmp.iterdir()) == []


def test_scratch_logs_are_removed_after_a_pass_and_kept_and_named_after_a_failure(tmp_path, monkeypatch):
    import io
    import tempfile

    from primerl.checklist.context import Fail, Step
    from primerl.checklist.runner import run_checklist

    def fails(ctx):
        (ctx.log_dir / "failing.log").write_text("what went wrong")
        raise Fail("broken")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = io.StringIO()
    run_checklist(None, tmp_path / "run", [Step("fine", "passes", 5, lambda ctx: "ok")], out=out)
    assert not list(tmp_path.glob("primerl-checklist-logs-*")) and "checklist logs" not in out.getvalue()
    run_checklist(None, tmp_path / "run", [Step("failing", "fails", 5, fails, writes_logs=True)], out=out)
    (kept,) = tmp_path.glob("primerl-checklist-logs-*")
    assert (kept / "failing.log").read_text() == "what went wrong"
    assert f"checklist logs: {kept}" in out.getvalue()


def test_concurrent_steps_run_together_on_a_cpu_machine_and_report_in_order(tmp_path):
    """The heavy steps marked concurrent run at the same time here (no GPU, 2+ cores): each of the two waits at a
    barrier for the other, which would break (failing both) if they ran one after the other. The next step starts only
    after both, and the report keeps the steps' order."""
    import io
    import threading

    from primerl.checklist.context import Step
    from primerl.checklist.runner import run_checklist

    barrier = threading.Barrier(2, timeout=60)
    order: list[str] = []

    def meets(name):
        def run(ctx):
            barrier.wait()
            order.append(name)
            return f"{name} met the other"
        return run

    steps = [Step("first", "waits for second", None, meets("first"), concurrent=True),
             Step("second", "waits for first", None, meets("second"), concurrent=True),
             Step("after", "runs after both", 10, lambda ctx: order.append("after") or "ran")]
    out = io.StringIO()
    report = run_checklist(None, tmp_path / "run", steps, log_dir=tmp_path / "logs", out=out)
    assert [(r.name, r.status) for r in report.steps] == [("first", "passed"), ("second", "passed"),
                                                         ("after", "passed")], out.getvalue()
    assert order[-1] == "after"
    assert report.as_dict()["seconds"] == report.seconds is not None  # the wall time, beside each step's own
    assert "first: waits for second ... (together with second)" in out.getvalue()


def test_concurrent_steps_run_one_after_the_other_where_the_machine_does_not_allow_it():
    from types import SimpleNamespace

    from primerl.checklist.runner import _groups
    from primerl.checklist.steps import STEPS

    heavy = ["sft_trainer", "rl_trainer", "inference"]
    assert [s.name for s in STEPS if s.concurrent] == heavy
    together = [[s.name for s in group] for group in _groups(STEPS, SimpleNamespace(concurrent_ok=lambda: True))]
    assert heavy in together and ["rl_smoke"] in together
    apart = [[s.name for s in group] for group in _groups(STEPS, SimpleNamespace(concurrent_ok=lambda: False))]
    assert apart == [[s.name] for s in STEPS]


def test_the_sft_trainer_step_is_skipped_for_a_recipe_without_an_sft_stage(tmp_path):
    report = tmp_path / "report.json"
    proc = check(str(TINY_RECIPE), "--only", "sft_trainer", "--run-dir", str(tmp_path / "run"), "--report", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert statuses(report)["sft_trainer"] == ("skipped", "the recipe has no sft stage")


def watched(tmp_path, monkeypatch, code: str, stall_timeout_s: float):
    """Follow a real child running `code` as a heavy step follows its command; the outcome and the progress lines."""
    from primerl.checklist.context import Context, Fail
    from primerl.checklist.heavy import _follow
    from primerl.launch.processes import ManagedProcess, stop_all
    from primerl.launch.progress import ProgressWatch

    monkeypatch.setattr(ProgressWatch, "SAMPLE_EVERY_S", 0.5)
    monkeypatch.setattr(ProgressWatch, "MIN_CPU_S", 0.01)
    monkeypatch.setattr(ProgressWatch, "HEARTBEAT_EVERY_S", 1.0)
    said: list[str] = []
    ctx = Context(None, tmp_path, tmp_path, tmp_path, said.append, stall_timeout_s=stall_timeout_s)
    child = ManagedProcess("child", [sys.executable, "-c", code], tmp_path / "child.log")
    child.start()
    watch = ProgressWatch(child, ctx.stall_timeout_s)
    try:
        while child.poll() is None:
            _follow(ctx, watch, "running the child")
            time.sleep(0.1)
    except Fail as e:
        return str(e), said
    finally:
        stop_all([child], grace_s=5)
    return f"exit {child.poll()}", said


def test_a_silent_idle_child_fails_as_stalled_naming_what_it_was_doing(tmp_path, monkeypatch):
    outcome, _ = watched(tmp_path, monkeypatch, "print('loading', flush=True); import time; time.sleep(600)", 3)
    assert outcome.startswith("no progress for 3 s while running the child"), outcome
    assert "last output: loading" in outcome


def test_a_silent_child_whose_grandchild_computes_is_not_killed(tmp_path, monkeypatch):
    """A slow step prints nothing for longer than the stall timeout, but the process it started keeps computing (as
    the trainer under `rl`, or one long step on a busy machine): that is progress."""
    spin = "import time; end = time.process_time() + 4\nwhile time.process_time() < end: pass"
    parent = f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {spin!r}]).returncode)"
    outcome, said = watched(tmp_path, monkeypatch, parent, 2)
    assert outcome == "exit 0"
    assert any("CPU-s; no new output for" in line for line in said), said


def test_unknown_step_names_are_a_usage_error():
    proc = check("--only", "pyton")
    assert proc.returncode == 2 and "pyton" in proc.stderr


@pytest.mark.integration
def test_the_full_checklist_passes_for_the_tiny_recipe(tmp_path):
    report = tmp_path / "report.json"
    proc = check(str(TINY_RECIPE), "--run-dir", str(tmp_path / "run"), "--report", str(report), timeout=3600)
    found = statuses(report)
    assert found.pop("flash_attn")[0] == "skipped"
    assert found.pop("sft_trainer") == ("skipped", "the recipe has no sft stage")
    assert {name: status for name, (status, _) in found.items()} == {name: "passed" for name in found}, found
    # The fake-data trainer step trains the recipe's own model, not the embedded default.
    assert "one micro-step on tiny, saved" in found["rl_trainer"][1], found["rl_trainer"]
    assert proc.returncode == 0


def test_the_step_names_configs_may_use_are_the_checklist_steps_in_order():
    from primerl.checklist.steps import STEPS
    from primerl.config.checklist import STEP_NAMES

    assert tuple(step.name for step in STEPS) == STEP_NAMES
