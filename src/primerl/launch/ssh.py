"""`primerl launch ssh recipe.toml`: an RL recipe on SSH hosts, through fabric.

1. Plan (`primerl.launch.plan`): the roles on the hosts, the configs; `--dry-run` prints it and stops.
2. Preflight, every host in parallel: reachable, its host key known (`primerl.launch.ssh_hosts`: known_hosts, or
   recorded on first contact with --accept-new-host-keys) and our key accepted; the run directory is the same
   directory on every host (a file one host writes, the others read); free disk; the software at the pinned version
   (`primerl.launch.host_software`; uv: the project's uv.lock has the pinned sha256 and `.venv` has its packages,
   synced when not with `uv sync --locked --inexact`, which keeps packages installed beside the lock (environments)
   and is reported package by package; image: the image id present, loaded from this machine's Docker daemon when
   missing).
3. The validation checklist on every host in parallel (`deploy.checklist_skip` leaves steps out); one table of all
   hosts' results. Any failure in 2 or 3 names the host, starts nothing, and exits 1.
4. The run directory gets the configs and the admin token (through the first host: the directory is shared), then the
   processes start: inference servers, orchestrator, trainer nodes (torchrun rendezvous on the first trainer host),
   each under `primerl.launch.remote`. Their output is streamed here, each line prefixed `[role.i@host]`.
5. Done when the orchestrator and every trainer node exit 0 (then the servers are stopped). A process that fails, or
   a run with no new metrics record for the rl stage's `stall_timeout_s`, stops every process on every host. While
   `max_restarts` allows (`--max-restarts N`, default the rl stage's: 3 for a recipe), the whole run then starts again
   on every host and resumes from its last complete checkpoint, as `rl` does (`primerl.launch.restart`: one line with
   the cause, a `restart` record in metrics.jsonl, a crash loop stops sooner); the bookkeeping runs on the first host,
   which sees the run directory. Otherwise the summary names the failing role and host (exit 1). Ctrl-C / SIGTERM
   stops every process on every host (exit 130).
"""

from __future__ import annotations

import io
import json
import shlex
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from primerl.config.deploy import DeployConfig
from primerl.launch.command import USAGE_ERROR, LaunchRequest
from primerl.launch.host_software import load_image, sync_environment
from primerl.launch.manifest import PLAN_FILE
from primerl.launch.plan import ADMIN_TOKEN_FILE, LaunchPlan, PlanError, RoleProcess, build_plan
from primerl.launch.processes import Terminated, raise_terminated
from primerl.launch.progress import root_cause
from primerl.launch.remote import STOP_LINE
from primerl.launch.restart import Failure, Progress, RestartPolicy, run_with_restarts, watch
from primerl.launch.ssh_hosts import HostError, HostKeys, connect

__all__ = ["HostError", "connect", "launch"]  # connect and HostError: the Slurm target's login host too

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
POLL_S = 0.25
METRICS_POLL_S = 5.0  # how often a stall check reads the size of metrics.jsonl on the first host
RUN_MARKERS = ("rollouts", "weights", "checkpoints", "metrics.jsonl")


def run_checked(conn, command: str, what: str, timeout_s: float | None = None) -> str:
    """Run `command` on the host; its output, or HostError with `what` and the output's last line."""
    result = conn.run(command, hide=True, warn=True, pty=False, timeout=timeout_s)
    if result.exited != 0:
        output = (result.stdout + result.stderr).strip().splitlines()
        raise HostError(f"{what}: exit {result.exited}: {output[-1] if output else 'no output'}")
    return result.stdout


# ---------------------------------------------------------------------------------------------------------------------
# Preflight


@dataclass
class HostReport:
    """What preflight and the checklist found on one host."""

    host: str
    steps: dict[str, tuple[str, str]] = field(default_factory=dict)  # step -> (status, detail)
    notes: dict[str, str] = field(default_factory=dict)  # step -> what it changed on the host (shown under the table)
    conn: Any = None

    @property
    def failed(self) -> list[str]:
        return [name for name, (status, _) in self.steps.items() if status == "failed"]

    def record(self, step: str, work: Callable[[], str]) -> bool:
        """Run one check; record passed/failed with its detail. False when it failed."""
        try:
            self.steps[step] = ("passed", work())
            return True
        except HostError as e:
            self.steps[step] = ("failed", str(e))
        except Exception as e:  # noqa: BLE001 -- a host that breaks a check (a dropped connection) failed it
            self.steps[step] = ("failed", f"{type(e).__name__}: {e}".splitlines()[0])
        return False


class SshTarget:
    """The SSH hosts of one launch: connections, preflight, file writes, processes."""

    def __init__(self, plan: LaunchPlan, out=sys.stdout):
        self.plan = plan
        self.deploy: DeployConfig = plan.deploy
        self.out = out
        self.reports = {host: HostReport(host) for host in plan.hosts}
        self.lock = threading.Lock()
        self.manifest_started = False  # the run's manifest.json was written (its rl stage's outcome is then recorded)

    def say(self, message: str) -> None:
        with self.lock:
            print(message, file=self.out, flush=True)

    def conn(self, host: str):
        return self.reports[host].conn

    def in_parallel(self, work: Callable[[HostReport], None]) -> None:
        with ThreadPoolExecutor(max_workers=len(self.reports)) as pool:
            list(pool.map(work, self.reports.values()))

    # -- preflight ---------------------------------------------------------------------------------------------------

    def preflight(self) -> bool:
        """Connect, check the shared run directory, disk and software on every host; False if any host failed."""
        self.in_parallel(self._connect)
        if any(r.failed for r in self.reports.values()):
            return False
        self._check_shared_run_dir()
        self.in_parallel(self._check_host)
        return not any(r.failed for r in self.reports.values())

    def _connect(self, report: HostReport) -> None:
        host = self.deploy.hosts[report.host]
        keys = HostKeys(self.deploy.known_hosts, self.deploy.accept_new_host_keys, self.say)

        def open_connection() -> str:
            report.conn = connect(host, self.deploy.connect_timeout_s, name=report.host, keys=keys)
            return f"{report.conn.user}@{report.conn.host}:{report.conn.port}"

        report.record("connect", open_connection)

    def _check_shared_run_dir(self) -> None:
        """The first host writes a probe file (and any file the hosts need before the run); every host reads it."""
        first, *others = self.plan.hosts
        run_dir = shlex.quote(self.plan.run_dir)
        nonce = uuid.uuid4().hex
        probe = f"{self.plan.run_dir}/launch/.shared-probe-{nonce}"
        early = {k: v for k, v in self.plan.files.items() if k.startswith("launch/")}

        def write_probe() -> str:
            found = run_checked(self.conn(first), f"mkdir -p {run_dir}/launch && cd {run_dir} && "
                                f"ls -d {' '.join(RUN_MARKERS)} 2>/dev/null; true", "run directory")
            if found.split():
                raise HostError(f"{self.plan.run_dir} already holds a run ({', '.join(found.split())}): choose another "
                                "deploy.run_dir")
            self.put(first, {**early, f"launch/.shared-probe-{nonce}": nonce})
            return f"{self.plan.run_dir} is writable"

        if not self.reports[first].record("run_dir", write_probe):
            return

        def read_probe(report: HostReport) -> None:
            def check() -> str:
                got = self.conn(report.host).run(f"cat {shlex.quote(probe)}", hide=True, warn=True).stdout.strip()
                if got != nonce:
                    raise HostError(f"does not see {first}'s files in {self.plan.run_dir}: deploy.run_dir must be on "
                                    "a filesystem every host shares")
                return f"sees {first}'s {self.plan.run_dir}"

            report.record("run_dir", check)

        with ThreadPoolExecutor(max_workers=max(1, len(others))) as pool:
            list(pool.map(read_probe, [self.reports[h] for h in others]))
        self.conn(first).run(f"rm -f {shlex.quote(probe)}", hide=True, warn=True)

    def _check_host(self, report: HostReport) -> None:
        if report.failed:
            return
        conn = self.conn(report.host)
        need_gb = self.plan.recipe.info.hardware.min_disk_gb

        def disk() -> str:
            out = run_checked(conn, f"df -Pk {shlex.quote(self.plan.run_dir)} | awk 'NR==2 {{print $4}}'", "df")
            free_gb = int(out.strip()) / 2**20
            if free_gb < need_gb:
                raise HostError(f"{free_gb:.1f} GiB free in {self.plan.run_dir}, the recipe needs {need_gb:g}")
            return f"{free_gb:.1f} GiB free"

        if report.record("disk", disk):
            report.record("software", lambda: self._software(conn, report))

    def _software(self, conn, report: HostReport) -> str:
        """uv: the project's uv.lock is the pinned one and its .venv is in sync with it (synced here if not, when
        deploy.software.sync); image: the pinned image id is present (loaded from here if not)."""
        sw = self.plan.software
        if sw.kind == "image":
            return self._image(conn)
        found = run_checked(conn, f"sha256sum {shlex.quote(sw.project_dir)}/uv.lock", "uv.lock").split()[0]
        pinned = self.plan.recipe.pins.lock_sha256
        if found != pinned:
            raise HostError(f"{sw.project_dir}/uv.lock has sha256 {found[:12]}..., the recipe pins {pinned[:12]}...")
        changed = sync_environment(conn, sw.project_dir, self.deploy.software.uv, self.deploy.software.sync)
        if changed is None:
            return f"uv environment has uv.lock {found[:12]}...'s packages"
        report.notes["software"] = f"uv sync --locked --inexact in {sw.project_dir}: {changed}"
        return f"uv environment synced from uv.lock {found[:12]}...: {changed}"

    def _image(self, conn) -> str:
        image = shlex.quote(str(self.plan.software.image))
        found = conn.run(f"docker image inspect --format '{{{{.Id}}}}' {image}", hide=True, warn=True)
        if found.exited == 0 and found.stdout.strip() == self.plan.software.image:
            return f"image {self.plan.software.image[:19]} present"
        load_image(conn, str(self.plan.software.image))
        return f"image {self.plan.software.image[:19]} loaded"

    def checklist(self) -> bool:
        """The checklist on every host in parallel, then one table of all hosts' results; False if any failed."""
        self.say(f"launch: checklist on {', '.join(self.reports)} ...")

        def run(report: HostReport) -> None:
            conn = self.conn(report.host)
            args = self.plan.checklist_args(report.host)
            result = conn.run(self.plan.software.shell(args, self.plan.host_env[report.host]), hide=True, warn=True)
            shown = conn.run(f"cat {shlex.quote(args[args.index('--report') + 1])}", hide=True, warn=True)
            try:
                steps = json.loads(shown.stdout)["steps"]
            except (ValueError, KeyError):
                why = root_cause(result.stdout + result.stderr)
                report.steps["checklist"] = ("failed", f"exit {result.exited}: {why}")
                return
            for step in steps:
                report.steps[step["name"]] = (step["status"], step["detail"])

        self.in_parallel(run)
        return not any(r.failed for r in self.reports.values())

    def table(self) -> str:
        """One row per host, one column per step, each column as wide as its widest cell; then what preflight
        changed on a host, and the detail of every failure."""
        steps = list(dict.fromkeys(s for r in self.reports.values() for s in r.steps))
        grid = [["host", *steps]] + [[host, *(report.steps.get(s, ("-", ""))[0] for s in steps)]
                                     for host, report in self.reports.items()]
        rows = aligned(grid)
        for host, report in self.reports.items():
            rows += [f"{host}: {name}: {note}" for name, note in report.notes.items()]
        for host, report in self.reports.items():
            rows += [f"{host}: {name} failed: {report.steps[name][1]}" for name in report.failed]
        return "\n".join(rows)

    # -- the run -----------------------------------------------------------------------------------------------------

    def put(self, host: str, files: dict[str, str], private: bool = False) -> None:
        """Write `files` (run-directory-relative path -> text) through `host`, each atomically (temp file, rename);
        `private` files are readable by their owner only. Plain shell, so hosts need no SFTP server."""
        conn = self.conn(host)
        for relative, text in files.items():
            path = shlex.quote(self.plan.path(relative))
            tmp = shlex.quote(f"{self.plan.path(relative)}.tmp")
            umask = "umask 077 && " if private else ""
            conn.run(f"{umask}mkdir -p \"$(dirname {path})\" && cat > {tmp} && mv {tmp} {path}",
                     in_stream=io.StringIO(text), hide=True, echo_stdin=False)

    def start(self, resume: bool = False) -> list[RemoteProcess]:
        """Write the run's files through the first host (a restart: the resumed run's process configs) and start every
        process of the plan."""
        first = self.plan.hosts[0]
        if resume:
            self.put(first, dict(self.plan.resume_files))
        else:
            checklist = {h: {step: status for step, (status, _) in r.steps.items()} for h, r in self.reports.items()}
            self.put(first, {**self.plan.files, PLAN_FILE: self.plan.record(checklist)})
            self.put(first, {ADMIN_TOKEN_FILE: self.plan.admin_token}, private=True)
            self.start_manifest()
        processes = []
        for p in self.plan.processes:
            command = self.plan.software.shell(self.plan.supervised_args(p), p.env)
            processes.append(RemoteProcess(p, self.conn(p.host), command, self.say))
        for rp in processes:
            rp.start()
        return processes

    # -- restarts: the bookkeeping runs on the first host, which sees the run directory --------------------------------

    def _python(self, args: list[str], what: str, stdin: str = "") -> str:
        first = self.plan.hosts[0]
        command = self.plan.software.shell(args, self.plan.host_env[first])
        result = self.conn(first).run(command, hide=True, warn=True, pty=False, in_stream=io.StringIO(stdin))
        if result.exited != 0:
            raise HostError(f"host {first}: {what}: exit {result.exited}: {root_cause(result.stdout + result.stderr)}")
        return result.stdout + result.stderr

    def start_manifest(self) -> None:
        """The run's manifest.json, built on the first host (`primerl.launch.manifest start`: its pins verified, its
        packages and facts, the launch record); HostError, and nothing starts, when a pin drifted there."""
        first = self.plan.hosts[0]
        self._python(["-m", "primerl.launch.manifest", "start", "--run-dir", self.plan.run_dir, "--recipe",
                      self.plan.recipe_on_hosts, "--host", first], "writing the manifest")
        self.manifest_started = True

    def end_manifest(self, code: int) -> None:
        """Record the run's outcome and restarts in its manifest, on the first host; a failure to is one line."""
        if not self.manifest_started:
            return
        try:
            self._python(["-m", "primerl.launch.manifest", "end", "--run-dir", self.plan.run_dir, "--exit-code",
                          str(code)], "recording the run's outcome in its manifest")
        except Exception as e:  # noqa: BLE001 -- a lost connection too: the run has ended, this is its last record
            self.say(f"launch: {e}".splitlines()[0])

    def trained_steps(self) -> int:
        """The newest step the trainer recorded in the run's metrics.jsonl."""
        out = self._python(["-m", "primerl.launch.restart", "steps", "--run-dir", self.plan.run_dir],
                           "reading the trained steps")
        return int(out.split()[-1])

    def record_restart(self, policy: RestartPolicy, failure: Failure, last_lines: str | None,
                       host: str | None) -> None:
        """`primerl.launch.restart`'s `record_restart` and `forget_what_is_redone` on the first host; their lines are
        printed here. `host`: the failed process's (None: a hung run, which process hung is unknown)."""
        args = ["-m", "primerl.launch.restart", "record", "--run-dir", self.plan.run_dir, "--restart",
                str(policy.restarts), "--max-restarts", str(policy.max_restarts), "--process", failure.process,
                "--cause", failure.cause, "--step", str(failure.step), *(["--host", host] if host else [])]
        for line in self._python(args, "recording the restart", last_lines or "").splitlines():
            self.say(line)

    def metrics_size(self) -> Callable[[], int]:
        """The size of the run's metrics.jsonl, read on the first host at most every `METRICS_POLL_S` seconds (the
        heartbeat of a stall check)."""
        path = shlex.quote(self.plan.path("metrics.jsonl"))
        last = {"at": float("-inf"), "size": 0}

        def size() -> int:
            if time.monotonic() - last["at"] >= METRICS_POLL_S:
                out = self.conn(self.plan.hosts[0]).run(f"stat -c %s {path} 2>/dev/null || echo 0", hide=True,
                                                        warn=True, pty=False).stdout.split()
                last.update(at=time.monotonic(), size=int(out[-1]) if out and out[-1].isdigit() else last["size"])
            return last["size"]

        return size

    def close(self) -> None:
        for report in self.reports.values():
            if report.conn is not None:
                report.conn.close()


def aligned(grid: list[list[str]]) -> list[str]:
    """The rows of `grid` as text, every column padded to its widest cell, two spaces between columns."""
    widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in grid]


class RemoteProcess:
    """One role process on its host: an SSH channel running `primerl.launch.remote`, its output streamed here."""

    def __init__(self, process: RoleProcess, conn, command: str, say: Callable[[str], None]):
        self.process = process
        self.conn = conn
        self.command = command
        self.say = say
        self.tail: deque[str] = deque(maxlen=40)
        self.code: int | None = None
        self.channel = None
        self.reader: threading.Thread | None = None

    @property
    def label(self) -> str:
        return self.process.label

    def start(self) -> None:
        self.channel = self.conn.create_session()
        self.channel.set_combine_stderr(True)
        self.channel.exec_command(self.command)
        self.reader = threading.Thread(target=self._read, name=self.label, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.channel is not None
        for raw in self.channel.makefile("rb"):
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            self.say(f"[{self.label}] {line}")
        code = self.channel.recv_exit_status()
        # the host side exits 128 + N when signal N ended the process (primerl.launch.remote); a local process's code
        # is then -N, which is what `Failure.exited` reads as "was killed by signal N"
        self.code = code if code <= 128 else 128 - code

    def poll(self) -> int | None:
        return self.code

    def stop(self) -> None:
        """Ask the host side to stop the process (SIGINT, grace, SIGKILL there)."""
        if self.channel is None or self.code is not None:
            return
        try:
            self.channel.sendall(f"{STOP_LINE}\n".encode())
            self.channel.shutdown_write()
        except OSError:
            pass

    def wait(self, timeout_s: float) -> None:
        if self.reader is not None:
            self.reader.join(timeout_s)
        if self.code is None and self.channel is not None:
            self.channel.close()  # the host side sees its stdin end and stops the process group


def stop_all(processes: list[RemoteProcess], grace_s: float) -> None:
    for p in processes:
        p.stop()
    deadline = time.monotonic() + grace_s + 15
    for p in processes:
        p.wait(max(0.1, deadline - time.monotonic()))


def failed_name(p: RemoteProcess) -> str:
    """A failed process as restart lines name it: `trainer.0 on host b`."""
    return f"{p.label.split('@')[0]} on host {p.process.host}"


def supervise(processes: list[RemoteProcess], plan: LaunchPlan, target: SshTarget) -> Failure | None:
    """Watch one attempt of the run on every host: None when it finished, else the `Failure` (every process was
    stopped)."""
    progress = Progress(target.metrics_size()) if plan.stall_timeout_s else Progress(lambda: 0)
    return watch(processes, name=failed_name, finishes=lambda p: p.process.finishes,
                 stop=lambda ps: stop_all(list(ps), plan.deploy.shutdown_grace_s),
                 steps_done=target.trained_steps, progress=progress, stall_timeout_s=plan.stall_timeout_s,
                 poll_s=POLL_S)


def failure_summary(plan: LaunchPlan, failure: Failure, failed: RemoteProcess | None, reason: str) -> str:
    """The line a run that stops for good ends with: role, host, address, the cause and why there is no restart, then
    the failed process's last lines."""
    if failed is None:  # the run hung: no process to blame
        return f"launch: FAILED: {reason}; every process was stopped; logs in {plan.path('logs')}"
    address = plan.deploy.hosts[failed.process.host].address
    tail = "\n".join(failed.tail)
    return (f"launch: FAILED: {failed.process.role} on host {failed.process.host} ({address}) {failure.cause} "
            f"({failed.label}): {root_cause(tail)}; every process was stopped ({reason}). Last lines of "
            f"{plan.log_path(failed.process)}:\n{tail}")


def run(target: SshTarget, plan: LaunchPlan, started: float, running: list[RemoteProcess]) -> int:
    """Start the run on every host and see it to its end, restarting it while the policy allows; `running` holds the
    processes of the current attempt (for a stop from outside)."""
    policy = RestartPolicy(plan.max_restarts)
    resume = False

    def attempt() -> int | Failure:
        running[:] = target.start(resume)
        failure = supervise(running, plan, target)
        if failure is not None:
            return failure
        where = "; ".join(f"{h}: {', '.join(p.label.split('@')[0] for p in running if p.process.host == h)}"
                          for h in plan.hosts)
        restarts = f", {policy.restarts} restart(s)" if policy.restarts else ""
        target.say(f"launch: done, {plan.max_steps} steps in {time.time() - started:.0f}s on {len(plan.hosts)} "
                   f"host(s) ({where}){restarts}; run directory {plan.run_dir}")
        return 0

    def failed_process(failure: Failure) -> RemoteProcess | None:
        return next((p for p in running if failed_name(p) == failure.process), None)

    def give_up(failure: Failure, reason: str) -> int:
        target.say(failure_summary(plan, failure, failed_process(failure), reason))
        return EXIT_FAILED

    def restart(failure: Failure) -> None:
        nonlocal resume
        failed = failed_process(failure)
        last_lines = (f"last lines of {plan.log_path(failed.process)}:\n" + "\n".join(failed.tail)
                      if failed is not None else None)
        target.record_restart(policy, failure, last_lines, failed.process.host if failed is not None else None)
        resume = True

    if plan.max_restarts:
        stall = f"{plan.stall_timeout_s:g}s without a new metrics record" if plan.stall_timeout_s else "off"
        interval = (f"checkpoints every {plan.checkpoint_interval} step(s)" if plan.checkpoint_interval
                    else "no periodic checkpoint (trainer.ckpt.interval): a restart begins again at step 0")
        target.say(f"launch: auto-restart: up to {plan.max_restarts} (max_restarts); stall check: {stall}; {interval}")
    return run_with_restarts(policy, attempt, give_up, restart)


def launch(request: LaunchRequest, out=sys.stdout) -> int:
    try:
        plan = build_plan(request.recipe, request.deploy, request.overrides)
    except PlanError as e:
        print(f"primerl launch ssh: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    print(plan.describe(), file=out, flush=True)
    if request.dry_run:
        return 0
    started = time.time()
    target = SshTarget(plan, out)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    processes: list[RemoteProcess] = []  # the current attempt's
    code = EXIT_FAILED
    try:
        ok = target.preflight() and target.checklist()
        target.say("\n" + target.table())
        if not ok:
            bad = [f"{h} ({', '.join(r.failed)})" for h, r in target.reports.items() if r.failed]
            target.say(f"launch: preflight failed on host(s) {'; '.join(bad)}; nothing was started")
            return EXIT_FAILED
        target.say(f"launch: starting {len(plan.processes)} processes on {', '.join(plan.hosts)}")
        code = run(target, plan, started, processes)
        return code
    except HostError as e:  # the manifest could not be written, or a restart's bookkeeping failed, on the first host
        target.say(f"launch: FAILED: {e}; every process was stopped")
        return EXIT_FAILED
    except (KeyboardInterrupt, Terminated):
        target.say("\nlaunch: interrupted; stopping every process on every host")
        stop_all(processes, plan.deploy.shutdown_grace_s)
        code = EXIT_INTERRUPTED
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_all(processes, plan.deploy.shutdown_grace_s)
        target.end_manifest(code)
        target.close()
