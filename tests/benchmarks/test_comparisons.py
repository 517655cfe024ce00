"""The bookkeeping of the side-by-side GPU benchmarks, on made-up side results (their smoke runs cannot reach these
paths on a CPU): which ratios exist, which run of the TRL-with-vLLM peer is kept, what a failed side leaves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import p1_gpu_matrix
import trl_accumulate
import vllm_offline
from sides import run_side


def side(rate: float, steady: float, card: str = "H100") -> dict:
    return {"rollouts_per_s": rate, "steady_rollouts_per_s": steady, "card": card}


def test_matrix_ratios_per_primerl_side_and_best_only_on_the_same_card():
    sides = {"primerl-embedded": side(30, 60), "primerl-vllm": side(40, 45), "trl-vllm": side(20, 30),
             "trl-generate": side(10, 12, card="H200")}
    got = p1_gpu_matrix.ratios(sides)
    assert got["steady_ratio_vs_trl_vllm"] == {"primerl-embedded": 2.0, "primerl-vllm": 1.5, "best": 2.0}
    assert got["overall_ratio_vs_trl_vllm"] == {"primerl-embedded": 1.5, "primerl-vllm": 2.0, "best": 2.0}
    assert "steady_ratio_vs_trl_generate" not in got  # another card: no ratio


def test_a_failed_side_gives_no_ratio():
    assert p1_gpu_matrix.ratios({"primerl-embedded": {"error": "exit 1", "card": "H100"},
                                 "trl-vllm": side(20, 30)}) == {}


def test_the_fastest_trl_vllm_setting_is_kept_and_every_try_listed():
    entry: dict = {"sides": {}}
    first = {**side(20, 30), "generation": {"mode": "vllm-colocate", "vllm_gpu_memory_utilization": 0.3}}
    entry["sides"]["trl-vllm"] = p1_gpu_matrix.keep_fastest_trl_vllm(entry, first)
    slower = {**side(18, 25), "generation": {"mode": "vllm-colocate", "vllm_sleep": True}}
    assert p1_gpu_matrix.keep_fastest_trl_vllm(entry, slower) is first
    faster = {**side(25, 35), "generation": {"mode": "vllm-colocate", "vllm_gpu_memory_utilization": 0.5}}
    assert p1_gpu_matrix.keep_fastest_trl_vllm(entry, faster) is faster
    assert [t["steady_rollouts_per_s"] for t in entry["trl_vllm_tried"]] == [30, 25, 35]


def test_primerl_settings_reach_rl_as_its_own_flags_and_a_malformed_one_is_refused(capsys):
    import e2e_vs_trl

    args = e2e_vs_trl.parse_args(["--smoke", "--primerl-set", "trainer.train.compile=true",
                                  "--primerl-set=trainer.train.warm_up_tokens=0"])
    command = e2e_vs_trl.rl_command(Path("c.toml"), Path("run"), args.primerl_set)
    assert command[-3:] == ["--output_dir=run", "--trainer.train.compile=true", "--trainer.train.warm_up_tokens=0"]
    for bad in ("compile", "=true", "--trainer.train.compile=true"):
        with pytest.raises(SystemExit) as exit_info:
            p1_gpu_matrix.main(["--smoke", f"--primerl-set={bad}"])
        assert exit_info.value.code == 2
        assert "expected KEY=VALUE" in capsys.readouterr().err


def test_a_cell_name_is_checked():
    assert p1_gpu_matrix.parse_cell("qwen3-0.6b/512/64x8") == ("qwen3-0.6b", 512, 64, 8)
    assert "qwen3-0.6b/512/64x8" in p1_gpu_matrix.cells() and len(p1_gpu_matrix.cells()) == 12
    with pytest.raises(SystemExit, match="ARCH/NEW_TOKENS/PROMPTSxGROUP"):
        p1_gpu_matrix.parse_cell("qwen3-0.6b-512")


def test_offline_ratios_need_both_sides_on_one_device():
    def measured(tok_s: float, device: str = "NVIDIA H100") -> dict:
        return {"device": device, "batches": {"64": {"tok_s": tok_s}}}

    sides = {"vllm-offline": measured(20000), "adapter": measured(11000), "server-vllm": measured(10000),
             "server-embedded": measured(25000, device="NVIDIA H200"), "embedded": {"skipped": "no GPU"}}
    got = vllm_offline.ratios(sides, [64, 256])
    assert got == {"64": {"adapter_over_vllm_offline": 0.55, "server_vllm_over_vllm_offline": 0.5,
                          "server_vllm_over_adapter": 0.909}}


def test_a_side_that_fails_or_runs_out_is_an_error_not_a_figure():
    ok = run_side([sys.executable, "-c", "print('noise'); print('{\"tok_s\": 5}')"], timeout_s=60)
    assert ok["tok_s"] == 5 and "error" not in ok
    failed = run_side([sys.executable, "-c", "import sys; print('{\"tok_s\": 5}'); sys.exit(3)"], timeout_s=60)
    assert failed["error"] == "exit 3" and "tok_s" not in failed
    slow = run_side([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=1)
    assert slow["error"].startswith("timed out") and "tok_s" not in slow


@pytest.mark.parametrize(("rollouts", "micro", "expected"), [(512, 16, (16, 32)), (128, 16, (16, 8)),
                                                              (8, 16, (8, 1)), (96, 64, (48, 2)), (7, 4, (1, 7))])
def test_the_peer_trains_its_step_in_equal_micro_batches_of_at_most_the_size_asked(rollouts, micro, expected):
    assert trl_accumulate.split(rollouts, micro) == expected


def test_a_micro_batch_of_nothing_is_refused():
    with pytest.raises(ValueError, match="positive"):
        trl_accumulate.split(512, 0)
