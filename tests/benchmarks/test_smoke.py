"""Every benchmark script runs in its smoke mode (`--smoke`, benchmarks/report.py: tiny model and sizes, CPU, no
network) as a subprocess, exits 0 and prints one JSON object, the same as the file it writes, marked as a smoke run
and holding the keys its readers use; the parts it cannot run here are named under "not_run". So a rename in src/
that breaks a benchmark fails the default tier instead of the next GPU session.

The cheap ones run first; the ones that start whole `rl` runs or several primerl processes are marked integration
(the default tier still runs them, last). drills.py's smoke run (four `rl` runs) is in the drills group and the
multi-node runs need root (launchers group); both groups are .ci/run's, and drills.py's imports are checked here.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
# the harness, side-process helpers, /proc readers, and the TRL peer's launcher (benchmarks/e2e_vs_trl.py runs it)
LIBRARIES = {"report.py", "sides.py", "procs.py", "trl_accumulate.py"}
TIMEOUT_S = 840  # per script; the smoke runs take seconds of CPU each, but the machine may be busy


@dataclass(frozen=True)
class Smoke:
    script: str
    keys: tuple[str, ...]  # top-level keys of the result
    not_run: tuple[str, ...] = ()  # parts the CPU cannot run, which the result must name
    args: tuple[str, ...] = ()
    launcher: tuple[str, ...] = ()  # what runs the script (default: this interpreter)
    out: str = "result.json"  # what --out names; a JSON file unless json_out is False
    json_out: bool = True
    marks: tuple[pytest.MarkDecorator, ...] = ()
    check: Callable[[dict], None] | None = None  # further assertions on the result

    @property
    def id(self) -> str:
        return self.script.removesuffix(".py")

    @property
    def drill(self) -> bool:
        return any(m.name == "drills" for m in self.marks)


def check_vllm_offline(result: dict) -> None:
    """The embedded sides measured (the in-process one profiled), the vLLM sides skipped with a reason, not passed."""
    sides = result["sides"]
    for side in ("server-embedded", "embedded"):
        for batch in ("2", "4"):
            assert sides[side]["batches"][batch]["tok_s"] > 0, sides[side]
    assert sides["embedded"]["profile"]["top_by_own_time"], sides["embedded"]
    assert sides["server-embedded"]["batches"]["4"]["cpu_s"]["process"] > 0
    for side in ("vllm-offline", "adapter", "server-vllm"):
        assert set(sides[side]) == {"skipped"} and sides[side]["skipped"], sides[side]
    assert set(result["ratios"]["4"]) == {"server_embedded_over_embedded"}, result["ratios"]


def check_e2e_vs_trl(result: dict) -> None:
    """Both of primerl's clocks, its backward dtype as the trainer resolved it, and the versions it ran with."""
    primerl = result["rounds"][0]["primerl"]
    assert primerl["cold_rollouts_per_s"] < primerl["rollouts_per_s"], primerl  # the cold clock covers more
    assert result["primerl_cold_rollouts_per_s"] == primerl["cold_rollouts_per_s"]
    assert result["primerl_backward_dtype"]["setting"] == "auto"
    assert result["primerl_backward_dtype"]["backward"] in ("bfloat16", "float32"), result["primerl_backward_dtype"]
    assert primerl["completion_tokens"] > 0
    assert isinstance(result["versions"]["primerl"]["torch"], str) and result["versions"]["primerl"]["transformers"]
    assert result["versions"]["trl"] is None and result["config"]["trl_generation"] == {"mode": "generate"}


def check_p1_gpu_matrix(result: dict) -> None:
    """The smoke cell holds primerl's embedded side with its figures and the card; nothing stands for the others."""
    cell = result["cells"]["tiny/4/1x2"]
    assert set(cell["sides"]) == {"primerl-embedded"}, cell["sides"]
    side = cell["sides"]["primerl-embedded"]
    assert side["rollouts_per_s"] > 0 and side["steady_rollouts_per_s"] > 0 and side["tokens_per_s"] > 0, side
    assert side["lost_rollouts"] == 0 and len(side["rewards"]) == 2 and side["card"] == "cpu", side
    assert side["versions"]["torch"] and side["backward_dtype"]["backward"] in ("bfloat16", "float32"), side
    assert not [k for k in cell if "_ratio_vs_" in k], cell  # no peer ran: no ratio


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=0")
INTEGRATION = (pytest.mark.integration,)
CASES = [
    Smoke("multinode_cpu.py", ("plans",), not_run=("layouts",)),
    Smoke("trainer.py", ("tokens_per_s", "hf_baseline_tokens_per_s", "ratio", "step_s")),
    Smoke("backward_dtype.py", ("step_s", "bfloat16_over_float32", "auto_resolves_to", "cpu_bf16_dot_products")),
    Smoke("weights.py", ("export_s", "num_bytes", "gib_per_s")),
    Smoke("engine.py", ("engine_tok_s", "hf_generate_tok_s", "hf_generate_batch_tok_s", "ratio"),
          not_run=("device_busy", "copy_bandwidth_gb_s")),
    Smoke("server_creep.py", ("growth_after_warm_up", "samples", "keep_freed_memory", "trim")),
    Smoke("decode_profile.py", ("eager",), not_run=("graph_replay", "compiled")),
    Smoke("vllm_h200.py", ("p3", "rl_commands"), not_run=("p3.vllm", "rl")),
    Smoke("vllm_offline.py", ("settings", "sides", "ratios"),
          not_run=("sides.vllm-offline", "sides.adapter", "sides.server-vllm"), marks=INTEGRATION,
          check=check_vllm_offline),
    Smoke("fsdp_one_rank.py", ("loss_first", "loss_last", "tokens_per_s", "weights"), launcher=TORCHRUN),
    Smoke("carry_site.py", ("needed", "packed", "tarball_mib"), out="site.tar.gz", json_out=False),
    Smoke("fuzz.py", ("http", "loaders")),
    Smoke("load_cpu.py", ("completed", "server_peak_rss_mb", "ok")),
    Smoke("server_overhead.py", ("settings", "runs", "loop_us_per_token", "tok_s")),
    Smoke("carry_vllm.py", ("pins", "part_budget_mib", "wheels_present")),
    Smoke("orchestrator_cpu.py", ("runs", "tasks_per_step"), marks=INTEGRATION),
    Smoke("fsdp_scaling.py", ("losses_match", "speedup", "loss_per_step"), marks=INTEGRATION),
    Smoke("weight_transfer.py", ("summary", "modes", "same_weights_across_modes"),
          not_run=("broadcast_nccl_same_gpu", "broadcast_nccl_2gpu", "nccl_probe"), marks=INTEGRATION),
    Smoke("multi_gpu.py", ("runs", "p4"), marks=INTEGRATION),
    Smoke("demo_cpu.py", ("wall_s", "rewards", "steps", "peak_pss_gib", "peak_pss_gib_by_process"),
          args=("--plot", "{tmp}/rewards.png"), marks=INTEGRATION),
    Smoke("startup.py", ("seconds_to_first_step", "checklist"), args=("--work-dir", "{tmp}/work"),
          marks=INTEGRATION),
    Smoke("e2e_vs_trl.py", ("primerl_rollouts_per_s", "primerl_rewards", "rounds", "primerl_cold_rollouts_per_s",
                            "cold_ratio", "clocks", "primerl_backward_dtype", "versions"), not_run=("trl",),
          args=("--work-dir", "{tmp}/work"), marks=INTEGRATION, check=check_e2e_vs_trl),
    Smoke("p1_gpu_matrix.py", ("benchmark", "cells"),
          not_run=("tiny/4/1x2.primerl-vllm", "tiny/4/1x2.trl-vllm", "tiny/4/1x2.trl-generate"),
          args=("--work-dir", "{tmp}/work"), marks=INTEGRATION, check=check_p1_gpu_matrix),
    Smoke("algorithms.py", ("rows", "summary", "distillation"), args=("--work-dir", "{tmp}/work"), marks=INTEGRATION),
    Smoke("reproduce.py", ("steps", "parts", "summary"), not_run=("demo",), args=("--work-dir", "{tmp}/work"),
          marks=INTEGRATION),
    Smoke("drills.py", ("drills", "auto_restart"), not_run=("ssh_restart",),
          marks=(pytest.mark.drills, pytest.mark.integration)),
    Smoke("trainer_memory.py", ("modes", "steps"), marks=INTEGRATION),
    Smoke("soak.py", ("runs", "steps_completed"), not_run=("demo",), args=("--work-dir", "{tmp}/work"),
          marks=INTEGRATION),
    Smoke("memory_fit.py", ("rows", "configs", "max_relative_error", "gpu"), not_run=("demo", "tiny_long_rows"),
          args=("--work-dir", "{tmp}/work"), marks=INTEGRATION),
]
DRILLS_VAR = "PRIMERL_DRILLS"


def run_script(case: Smoke, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [*(case.launcher or (sys.executable,)), str(BENCHMARKS / case.script), *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_smoke_run_prints_its_result_as_json(case: Smoke, tmp_path: Path):
    if case.drill and os.environ.get(DRILLS_VAR) != "1":
        pytest.skip(f"the drills are opt-in ({DRILLS_VAR}=1 pytest -m drills; .ci/run runs them as their own group)")
    out = tmp_path / case.out
    args = [a.format(tmp=tmp_path) for a in case.args]
    done = run_script(case, tmp_path, "--smoke", "--out", str(out), *args)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-6000:]}"
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(f"stdout is not one JSON object ({e}):\n{done.stdout[-3000:]}") from None
    assert result["run"]["smoke"] is True
    assert {"commit", "host", "load_average_start", "load_average_end"} <= set(result["run"])
    assert set(case.keys) <= set(result), sorted(result)
    named = result.get("not_run", {})
    assert set(case.not_run) <= set(named), named
    assert all(isinstance(why, str) and why for why in named.values()), named
    for part in named:  # said on stderr too, not only in the file
        assert f"{part}: not run: " in done.stderr
    if case.check is not None:
        case.check(result)
    if case.json_out:
        written = json.loads(out.read_text())
        assert written == result or result in written.values()  # weights.py keeps one result per device/model
    else:
        with tarfile.open(out) as tar:
            assert len(tar.getnames()) > 0


def test_every_script_has_a_smoke_case_and_a_smoke_flag():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - LIBRARIES
    assert scripts == {c.script for c in CASES}
    for script in sorted(scripts):
        tree = ast.parse((BENCHMARKS / script).read_text())
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "add_smoke_flag" in calls, f"{script} has no --smoke (report.add_smoke_flag)"
        assert "emit" in calls, f"{script} does not hand its result to report.emit"


@pytest.mark.parametrize("case", [c for c in CASES if c.drill], ids=lambda c: c.id)
def test_scripts_smoked_only_in_an_opt_in_group_still_import_and_parse(case: Smoke, tmp_path: Path):
    done = run_script(case, tmp_path, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--smoke" in done.stdout


@pytest.mark.launchers
@pytest.mark.system
def test_multinode_runs_one_layout_on_namespace_hosts(tmp_path: Path):
    """Not a smoke run: the one-host layout for 2 steps on a host made here (root, sshd, network namespaces)."""
    if os.environ.get("PRIMERL_LAUNCHER_TESTS") != "1":
        pytest.skip("launcher tests are opt-in (PRIMERL_LAUNCHER_TESTS=1 pytest -m launchers; .ci/run's own group)")
    sys.path.insert(0, str(REPO / "tests" / "system"))
    from netns_hosts import missing_tools

    if why := missing_tools():
        pytest.skip(f"cannot make SSH hosts here: {why}")
    case = next(c for c in CASES if c.script == "multinode_cpu.py")
    out = tmp_path / "multinode.json"
    done = run_script(case, tmp_path, "--steps", "2", "--layouts", "one_host", "--out", str(out))
    assert done.returncode == 0, done.stderr[-6000:]
    layout = json.loads(out.read_text())["layouts"]["one_host"]
    assert layout["steps_completed"] == 2 and layout["seconds_per_step"] is not None, layout
