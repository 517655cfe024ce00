"""The names of the validation checklist's steps, in the order it runs them: what `primerl check --only/--skip` and
`deploy.checklist_skip` may name. The steps themselves are `primerl.checklist.steps.STEPS`, one per name, in this
order; the names live here so that configs can check them without importing the checklist.
"""

from __future__ import annotations

STEP_NAMES = ("python", "torch", "flash_attn", "disk", "memory", "ports", "run_dir", "model", "memory_fit",
              "environment", "sft_trainer", "rl_trainer", "inference", "rl_smoke")
