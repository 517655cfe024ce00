"""`primerl launch slurm recipe.toml`: an RL recipe as one Slurm job, rendered from `templates/job.sbatch.j2`.

The job first runs the validation checklist on every node (`srun`, one report per node in `<run>/checklist/`), then:
on one node, the recipe's stages through the local launcher (`primerl run --no-check`); on several, the plan's roles
(`primerl.launch.plan`): inference servers on the first `slurm.inference_nodes` nodes (the orchestrator on the first
node), trainer nodes on the rest under torchrun, one `srun` each. Nodes are known only inside the job, so the plan's
addresses are the job's `NODES` array.

The launcher submits with `sbatch` here, or on `slurm.login_host` over SSH (fabric); follows the job with `squeue`,
prints its log as it grows, and at the end reads the job's state from `sacct` (from the job completion log when the
cluster keeps no accounting database). Exit 0 when the job COMPLETED; otherwise 1 with the log's last lines. Ctrl-C
cancels the job (`scancel`) and exits 130. `--dry-run` prints the script.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primerl.config.deploy import DeployConfig, RolesSection
from primerl.launch.command import USAGE_ERROR, LaunchRequest
from primerl.launch.plan import ADMIN_TOKEN_FILE, LaunchPlan, PlanError, build_plan
from primerl.recipes.schema import Recipe

TEMPLATES = Path(__file__).parent / "templates"
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
TAIL_LINES = 40
CANCEL_WAIT_S = 120
_NODE = re.compile(r"@NODE(\d+)@")
NODE_OF_TASK = "@NODE_OF_TASK@"


def node_roles(deploy: DeployConfig) -> RolesSection:
    """The roles of a job: servers on the first inference_nodes nodes, the orchestrator on node 0, trainers on the
    others (on node 0 too in a one-node job)."""
    slurm = deploy.slurm
    nodes = [f"node{i}" for i in range(slurm.nodes)]
    return RolesSection(inference=nodes[: slurm.inference_nodes], orchestrator=nodes[0],
                        trainer=nodes[slurm.inference_nodes:] or nodes,
                        trainer_ranks_per_host=max(1, slurm.gpus_per_node))


def shell_words(argv: list[str]) -> str:
    """`argv` quoted for bash, with `@NODE<i>@` placeholders becoming "${NODES[i]}" and `@NODE_OF_TASK@` the node
    the task runs on."""
    words = []
    for word in argv:
        quoted = shlex.quote(word)
        inside = quoted.startswith("'")
        var = (lambda m: f"'\"${{NODES[{m.group(1)}]}}\"'") if inside else (lambda m: f'"${{NODES[{m.group(1)}]}}"')
        quoted = _NODE.sub(var, quoted)
        quoted = quoted.replace(NODE_OF_TASK, "'\"$SLURMD_NODENAME\"'" if inside else '"$SLURMD_NODENAME"')
        words.append(quoted.replace("$UID_GID", '"$(id -u):$(id -g)"'))
    return " ".join(words)


@dataclass
class Job:
    script: str
    plan: LaunchPlan | None  # multi-node: the roles' plan (its files are written before submitting)
    log: str
    script_path: str


def render(recipe: Recipe, deploy: DeployConfig, overrides: dict[str, Any]) -> Job:
    """The job script for `recipe` under `deploy`. PlanError for what cannot work."""
    import jinja2

    slurm = deploy.slurm
    multi = slurm.nodes > 1
    deploy = deploy.model_copy(update={"roles": node_roles(deploy)})
    plan = build_plan(recipe, deploy, overrides, address_of=lambda host: f"@NODE{host.removeprefix('node')}@",
                      gpus=slurm.gpus_per_node > 0)
    sw = plan.software
    checklist = sw.argv(plan.checklist_args(NODE_OF_TASK), plan.host_env[plan.processes[0].host])
    checklist_line = f"cd {shlex.quote(sw.project_dir)} && exec {shell_words(checklist)}"
    processes = []
    if multi:
        for p in plan.processes:
            argv = sw.argv(plan.supervised_args(p), p.env)
            processes.append({"node": int(p.host.removeprefix("node")), "label": shlex.quote(p.label),
                              "finishes": p.finishes, "command": f"--chdir={shlex.quote(sw.project_dir)} "
                              f"{shell_words(argv)} < /dev/null"})
    stage_options = [f"--{stage}.{key}={value}" for stage, values in overrides.items()
                     for key, value in _dotted(values)]
    run_args = ["-m", "primerl.cli", "run", plan.recipe_on_hosts, "--no-check", "--run-dir", plan.run_dir,
                *stage_options]
    # a requeued one-node job records its restart (primerl.launch.restart) before it resumes the run
    requeued_args = ["-m", "primerl.launch.restart", "requeued", "--run-dir", plan.run_dir, "--prefix", "primerl",
                     "--host", NODE_OF_TASK]
    node0_env = plan.host_env[plan.processes[0].host]
    # several nodes: the run's manifest (primerl.launch.manifest), built on the first node, the rl stage's outcome last
    on_node0 = f'srun --overlap --nodes=1 --ntasks=1 --nodelist="${{NODES[0]}}" --chdir={shlex.quote(sw.project_dir)}'
    manifest = ["-m", "primerl.launch.manifest"]
    manifest_start = shell_words(sw.argv([*manifest, "start", "--run-dir", plan.run_dir, "--recipe",
                                          plan.recipe_on_hosts, "--host", "@NODE0@"], node0_env))
    manifest_end = shell_words(sw.argv([*manifest, "end", "--run-dir", plan.run_dir, "--exit-code"], node0_env))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    log = plan.path("logs/slurm-%j.out")
    script = env.get_template("job.sbatch.j2").render(
        recipe=recipe.name, job_name=f"primerl-{recipe.name}", nodes=slurm.nodes, time_limit=slurm.time_limit,
        log=log, partition=slurm.partition, account=slurm.account, gpus_per_node=slurm.gpus_per_node,
        cpus_per_node=slurm.cpus_per_node, extra=slurm.extra, run_dir=plan.run_dir,
        checklist=shlex.quote(checklist_line), processes=processes,
        run=f"cd {shlex.quote(sw.project_dir)}\n{shell_words(sw.argv(run_args, node0_env))}",
        requeued=f"(cd {shlex.quote(sw.project_dir)} && {shell_words(sw.argv(requeued_args, node0_env))} "
                 '--job "$SLURM_JOB_ID" --count "$SLURM_RESTART_COUNT")',
        manifest_start=f"{on_node0} {manifest_start} < /dev/null",
        manifest_end=f'{on_node0} {manifest_end} "$1" < /dev/null',
    )
    return Job(script, plan if multi else None, log, plan.path("launch/job.sbatch"))


def _dotted(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _dotted(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


class Shell:
    """Where Slurm's commands run: here, or on the login host over SSH."""

    def __init__(self, deploy: DeployConfig):
        self.conn = None
        if deploy.slurm.login_host is not None:
            from primerl.launch.ssh import connect

            self.conn = connect(deploy.hosts[deploy.slurm.login_host], deploy.connect_timeout_s)

    def run(self, command: str) -> tuple[int, str]:
        if self.conn is not None:
            result = self.conn.run(command, hide=True, warn=True, pty=False)
            return result.exited, result.stdout + result.stderr
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False)
        return done.returncode, done.stdout + done.stderr

    def write(self, path: str, text: str, private: bool = False) -> None:
        quoted, tmp = shlex.quote(path), shlex.quote(path + ".tmp")
        umask = "umask 077 && " if private else ""
        command = f"{umask}mkdir -p \"$(dirname {quoted})\" && cat > {tmp} && mv {tmp} {quoted}"
        if self.conn is not None:
            import io

            self.conn.run(command, in_stream=io.StringIO(text), hide=True, echo_stdin=False)
        else:
            subprocess.run(["bash", "-c", command], input=text, text=True, check=True)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def job_state(shell: Shell, job_id: str) -> tuple[str, str]:
    """(state, exit code) of an ended job from sacct; from the job completion log when accounting is off. A job that
    was requeued has one line per start there (the first one's state PENDING): the last line is its latest start's."""
    for extra in ("", "--completion "):
        code, out = shell.run(f"sacct {extra}-j {job_id} -X -n -P -o JobID,State,ExitCode")
        rows = [fields for line in out.splitlines()
                if len(fields := line.strip().split("|")) == 3 and fields[0] == job_id]
        if code == 0 and rows:
            return rows[-1][1].split()[0], rows[-1][2]
    return "UNKNOWN", "?"


def wait_for_end(shell: Shell, job_id: str, timeout_s: float) -> str:
    """Wait (up to `timeout_s`) for the job to leave the queue; its final state, or 'still ending'."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, queued = shell.run(f"squeue -h -j {job_id} -o %T")
        if not queued.strip() or queued.strip().startswith("slurm_load_jobs error"):
            return job_state(shell, job_id)[0]
        time.sleep(0.5)
    return "still ending"


def follow(shell: Shell, job_id: str, log: str, poll_s: float, out=sys.stdout) -> tuple[str, str]:
    """Print the job's log as it grows until the job leaves the queue; then its final state."""
    offset = 0
    while True:
        _, queued = shell.run(f"squeue -h -j {job_id} -o %T")
        code, text = shell.run(f"tail -c +{offset + 1} {shlex.quote(log)} 2>/dev/null")
        if code == 0 and text:
            offset += len(text.encode())
            out.write(text)
            out.flush()
        if not queued.strip() or queued.strip().startswith("slurm_load_jobs error"):
            state = job_state(shell, job_id)
            if state[0] not in ("UNKNOWN", "RUNNING", "PENDING", "COMPLETING"):
                _, rest = shell.run(f"tail -c +{offset + 1} {shlex.quote(log)} 2>/dev/null")
                out.write(rest)
                out.flush()
                return state
        time.sleep(poll_s)


def launch(request: LaunchRequest, out=sys.stdout) -> int:
    prog = "primerl launch slurm"
    try:
        job = render(request.recipe, request.deploy, request.overrides)
    except PlanError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    if request.dry_run:
        print(job.script, file=out, end="")
        if job.plan is not None:
            print("\n# " + job.plan.describe().replace("\n", "\n# "), file=out)
        return 0
    deploy = request.deploy
    shell = Shell(deploy)
    job_id = None
    try:
        if job.plan is not None:
            for relative, text in {**job.plan.files, "launch/plan.json": job.plan.record()}.items():
                shell.write(job.plan.path(relative), text)
            shell.write(job.plan.path(ADMIN_TOKEN_FILE), job.plan.admin_token, private=True)
        shell.write(job.script_path, job.script)
        shell.run(f"mkdir -p {shlex.quote(job.log.rsplit('/', 1)[0])}")  # Slurm does not create the log's directory
        code, text = shell.run(f"sbatch --parsable {shlex.quote(job.script_path)}")
        if code != 0:
            print(f"{prog}: sbatch failed: {text.strip().splitlines()[-1] if text.strip() else code}", file=sys.stderr)
            return EXIT_FAILED
        job_id = text.strip().splitlines()[-1].split(";")[0]
        log = job.log.replace("%j", job_id)
        print(f"launch: submitted job {job_id}; log {log}", file=out, flush=True)
        state, exit_code = follow(shell, job_id, log, deploy.slurm.poll_s, out)
        if state == "COMPLETED":
            print(f"launch: job {job_id} COMPLETED; run directory {deploy.run_dir}", file=out, flush=True)
            return 0
        _, tail = shell.run(f"tail -n {TAIL_LINES} {shlex.quote(log)}")
        print(f"launch: FAILED: job {job_id} ended {state} (exit code {exit_code}); last lines of {log}:\n{tail}",
              file=out, flush=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        if job_id is not None:
            shell.run(f"scancel {job_id}")
            state = wait_for_end(shell, job_id, CANCEL_WAIT_S)
            print(f"\nlaunch: interrupted; cancelled job {job_id} ({state})", file=out, flush=True)
        return EXIT_INTERRUPTED
    finally:
        shell.close()
