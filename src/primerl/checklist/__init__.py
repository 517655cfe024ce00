"""The validation checklist — can this machine run this recipe, here and now?

Steps, in order (`--only` / `--skip` pick them by name):

    python       the Python version matches the recipe's pin
    torch        torch imports and sees the GPUs the recipe needs
    flash_attn   flash_attn imports (recipes that train on GPUs)
    disk         the run directory's file system has the free space the recipe asks for
    memory       the host has the memory the recipe asks for
    ports        the TCP ports the run will bind are free
    run_dir      the run directory can be created and written
    model        the model files are present with the pinned hashes
    memory_fit   each process's peak memory, estimated from the model and the run's sizes (checklist/memory.py),
                 fits the machine's available memory (and on GPUs each device's memory, the processes that
                 share a device summed); printed beside it
    environment  the rl stage's environment loads with the recipe's `env.args` and yields a task
    sft_trainer  `primerl sft` trains one micro-step of configs/debug/fake/sft.toml and saves (recipes with an sft
                 stage, on the recipe's model; without a recipe on the fake config's own model)
    rl_trainer   `primerl trainer` trains one micro-step of configs/debug/fake/rl.toml and saves (on the recipe's model
                 when a recipe is given)
    inference    `primerl inference` serves the recipe's model: /health, /v1/models, one chat completion
    rl_smoke     `primerl rl` runs the recipe's smoke variant (a few steps of the whole stack)

A step ends `passed`, `failed`, or `skipped` with the reason — a step that cannot run on this machine (a GPU step
without a GPU) is skipped, never passed. The heavy steps run the real commands as subprocesses; their output goes to
`<run>/logs/checklist/<step>.log` (`primerl check` and `rl` alike; nothing is left in the temporary directory). The
console gets progress lines and a table; the JSON report (default `<run dir>/checklist.json`) gets every step's
status, detail and duration. Exit code: 0 when nothing failed, 1 when a step failed, 2 on a usage or recipe error.

On a CPU-only machine with two or more cores, `sft_trainer`, `rl_trainer` and `inference` run at the same time (each
is one process of one compute thread with its own files and port; `benchmarks/NOTES.md` has the demo's checklist on
2 cores before and after); with GPUs they run one after the other, so a trainer and a server never
compete for one device's memory. `rl_smoke` always runs after them.

Time limits: the light steps have fixed ones (seconds of work each). The heavy steps have none that a busy machine
can hit: they run as long as the child processes make progress -- new output in their log, or CPU time spent by the
child and everything it started -- and fail only after `--stall-timeout` seconds (default 300) without either, naming
what they were doing. A slow machine slows a child down but it keeps spending CPU; a stuck one does neither.

Modules: `context` (a step, what it sees, Skip and Fail), `machine` (the light steps), `memory` (the memory
estimate), `heavy` (the steps that run primerl commands), `steps` (their order), `runner` (running them), `report` (results, table, JSON). The command line is
`primerl.commands.check`.
"""
