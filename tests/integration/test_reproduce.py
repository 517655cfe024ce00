"""`primerl reproduce` end to end on the tiny recipe: a run started with `--deterministic` replays bit for bit (every
step's tokens, reward, loss, grad norm and weight checksum equal), and a replay whose setup differs in one setting is
flagged at its first differing step and field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = REPO / "recipes" / "tiny.toml"
STEPS = 2

pytestmark = pytest.mark.integration


def primerl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primerl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def deterministic_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reproduce") / "run"
    result = primerl("rl", str(TINY_RECIPE), "--run-dir", str(run), "--no-check", "--deterministic",
                     f"--rl.max_steps={STEPS}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run


def test_a_deterministic_run_records_what_it_fixes(deterministic_run):
    manifest = json.loads((deterministic_run / "manifest.json").read_text())
    assert manifest["determinism"]["deterministic"] and manifest["determinism"]["settings"]["max_async_steps"] == 0
    assert manifest["environment"]["sha256"] == manifest["pins"]["declared"]["environment"]["sha256"]
    trainer = [json.loads(line) for line in (deterministic_run / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["source"] == "trainer"]
    assert [len(r["weight_checksum"]) for r in trainer] == [64] * STEPS
    assert len({r["weight_checksum"] for r in trainer}) == STEPS  # each step changed the weights


def test_a_deterministic_run_replays_bit_for_bit(deterministic_run, tmp_path):
    result = primerl("reproduce", str(deterministic_run), "--steps", str(STEPS), "--out", str(tmp_path / "replay"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "replay" / "reproduce.json").read_text())
    assert report["exact"] and report["equal"] and report["first_difference"] is None
    assert [s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
    for step in report["steps"]:
        assert set(step["verdicts"].values()) == {"equal"}, step
        assert step["original"] == step["replay"] and step["original"]["weight_checksum"], step
    assert "every compared field is equal" in result.stderr


def test_a_changed_setup_is_flagged_at_its_first_differing_step_and_field(deterministic_run, tmp_path):
    """The same run with another learning rate in its manifest: step 1's rollouts, loss and gradient come from the
    initial weights and are equal; the weights after step 1 are not."""
    changed = tmp_path / "changed"
    changed.mkdir()
    manifest = json.loads((deterministic_run / "manifest.json").read_text())
    optim = manifest["stages"]["rl"]["config"]["trainer"]["optim"]
    optim["lr"] = optim["lr"] * 10
    (changed / "manifest.json").write_text(json.dumps(manifest))
    (changed / "metrics.jsonl").write_text((deterministic_run / "metrics.jsonl").read_text())
    (changed / "rollouts").symlink_to(deterministic_run / "rollouts")
    result = primerl("reproduce", str(changed), "--steps", str(STEPS), "--out", str(tmp_path / "replay"))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 1 differs first, in weight_checksum" in result.stderr
    report = json.loads((tmp_path / "replay" / "reproduce.json").read_text())
    first = report["steps"][0]["verdicts"]
    assert {k: first[k] for k in ("tokens", "reward", "loss", "grad_norm")} == dict.fromkeys(
        ("tokens", "reward", "loss", "grad_norm"), "equal")
    assert report["first_difference"] == {"step": 1, "field": "weight_checksum"}
