"""The checklist's steps, in the order they run: the light ones (seconds each, fixed time limits) first, then the heavy
ones (real primerl commands; they fail only when their child stops making progress). `select_steps` picks them by
name for `--only` / `--skip`; the names are `primerl.config.checklist.STEP_NAMES`, which configs may use.
"""

from __future__ import annotations

from collections.abc import Sequence

from primerl.checklist.context import Step
from primerl.checklist.heavy import (
    FAKE_RL_CONFIG,
    FAKE_SFT_CONFIG,
    check_inference,
    check_rl_smoke,
    check_rl_trainer,
    check_sft_trainer,
)
from primerl.checklist.machine import (
    check_disk,
    check_environment,
    check_flash_attn,
    check_memory,
    check_model,
    check_ports,
    check_python,
    check_run_dir,
    check_torch,
)
from primerl.checklist.memory import check_memory_fit
from primerl.config.base import require_known
from primerl.config.checklist import STEP_NAMES

STEPS: tuple[Step, ...] = (
    Step("python", "Python version matches the pin", 10, check_python),
    Step("torch", "torch imports and sees the GPUs the recipe needs", 330, check_torch),
    Step("flash_attn", "flash_attn imports (GPU recipes)", 330, check_flash_attn),
    Step("disk", "free disk space for the run directory", 10, check_disk),
    Step("memory", "host memory", 10, check_memory),
    Step("ports", "the ports the run binds are free", 10, check_ports),
    Step("run_dir", "the run directory is writable", 30, check_run_dir),
    Step("model", "model files present with the pinned hashes", 1800, check_model),
    Step("memory_fit", "each process's estimated peak memory fits what the machine has", 60, check_memory_fit),
    Step("environment", "the rl stage's environment loads with the recipe's env.args", 330, check_environment),
    Step("sft_trainer", f"primerl sft trains one micro-step of {FAKE_SFT_CONFIG} and saves",
         None, check_sft_trainer, writes_logs=True, concurrent=True),
    Step("rl_trainer", f"primerl trainer trains one micro-step of {FAKE_RL_CONFIG} and saves",
         None, check_rl_trainer, writes_logs=True, concurrent=True),
    Step("inference", "the inference server answers /health, /v1/models and a chat request",
         None, check_inference, writes_logs=True, concurrent=True),
    Step("rl_smoke", "the full RL stack runs the recipe's smoke variant",
         None, check_rl_smoke, writes_logs=True),
)


def select_steps(only: Sequence[str] = (), skip: Sequence[str] = ()) -> list[Step]:
    require_known([*only, *skip], STEP_NAMES, "step(s)", "steps")
    return [s for s in STEPS if (not only or s.name in only) and s.name not in skip]

