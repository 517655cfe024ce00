"""`primerl orchestrator`: the async step loop that turns environment rollouts into training batches.

Contract:
- For step n = 0, 1, ... it samples `tasks_per_step` tasks, runs `group_size` rollouts of each against the inference
  server (verifiers bridge, renderer client: token ids, sampling mask and log-probs per sample), computes advantages
  per group, and publishes `rollouts/step_<n>/` atomically (`primerl.transport.rollouts.write_batch`).
- The async rule (`scheduler.PolicyBound`): rollouts for step n start only once inference holds policy >= n -
  max_async_steps; samples older than the off-policy limit are dropped and counted. Groups whose advantages are all
  zero are dropped (configurable) and replaced by new tasks, up to `max_extra_groups` per step.
- It watches `weights/` and loads each newer STABLE snapshot into the server through `POST /admin/update_weights`.
- After each batch it appends a record to metrics.jsonl (source "orchestrator", `"step": n + 1` = the training step
  that consumes `rollouts/step_<n>`, `"rollout_step": n`) and, every `ckpt.interval` batches,
  saves its progress to `checkpoints/step_<k>/orchestrator/state.json` (k = batches written) for `--resume`.

Groups run in this process (`groups.GroupRunner`) or in `workers` worker processes (`workers.WorkerPool`); either
way the tasks, the bound, scoring, batches and checkpoints stay here, so task order and resume do not depend on it.

Torch-free: it imports verifiers, httpx and numpy, never a model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

from primerl.config import config_from_argv
from primerl.config.orchestrator import OrchestratorConfig
from primerl.monitor import MetricsLogger
from primerl.orchestrator import verifiers_bridge
from primerl.orchestrator.algorithm import Algorithm
from primerl.orchestrator.client import InferencePool
from primerl.orchestrator.groups import GroupRunner, RolloutSetup, quiet_libraries
from primerl.orchestrator.progress import Progress, resume_progress, save_progress
from primerl.orchestrator.sampler import task_sampler
from primerl.orchestrator.scheduler import PolicyBound
from primerl.orchestrator.steps import Group, StepStats, score_group, step_metrics, to_batch_sample, trainable
from primerl.orchestrator.workers import WorkerFailed, WorkerPool, open_groups, worker_count
from primerl.storage import storage_failure
from primerl.transport import rollouts as batches
from primerl.transport import snapshots

log = logging.getLogger("primerl.orchestrator")

MAX_FAILED_GROUPS_IN_A_ROW = 16  # groups whose every rollout errored, in a row, before the orchestrator gives up


class RolloutsFailing(RuntimeError):
    """Every rollout of `MAX_FAILED_GROUPS_IN_A_ROW` groups in a row failed: the run cannot produce a batch."""


# ---------------------------------------------------------------------------------------------------------------------
# The policy inference serves


class PolicyTracker:
    """Knows the policy version the servers sample with and moves it forward: each newer STABLE `weights/step_<k>/`
    is loaded into every server (`InferencePool.update_weights`). `changed` is set after every load."""

    def __init__(self, pool: InferencePool, run_dir: Path, poll_s: float):
        self.pool = pool
        self.run_dir = run_dir
        self.poll_s = poll_s
        self.changed = pool.changed

    @property
    def version(self) -> int:
        return self.pool.version

    @property
    def last_update_s(self) -> float | None:
        return self.pool.last_update_s

    async def load_newest(self) -> bool:
        """Load the newest STABLE snapshot if it is newer than what a server holds. True when one was loaded."""
        newest = snapshots.latest_stable(self.run_dir)
        if newest is None or newest[0] <= self.version:
            return False
        return await self.pool.update_weights(*newest)

    async def watch(self) -> None:
        while True:
            await self.load_newest()
            await asyncio.sleep(self.poll_s)


# ---------------------------------------------------------------------------------------------------------------------
# The loop


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.bound = PolicyBound(cfg.max_async_steps, cfg.off_policy_limit)
        self.algorithm = Algorithm(cfg)
        if warning := cfg.sampling.biased_ratio_warning():
            log.warning(warning)
        self.max_extra_groups = (
            cfg.batch.tasks_per_step if cfg.batch.max_extra_groups is None else cfg.batch.max_extra_groups
        )
        self.progress = resume_progress(self.run_dir) if cfg.resume else Progress()
        self.metrics = MetricsLogger(
            self.run_dir, "orchestrator", wandb=cfg.wandb, config={"orchestrator": cfg.model_dump(mode="json")}
        )
        self.groups: GroupRunner | WorkerPool | None = None  # where groups run (`run` opens it)
        self.pending: set[asyncio.Task] = set()
        self.ready: deque[Group] = deque()
        self.stats = StepStats()
        self.extra_groups_used = 0
        self.failed_in_a_row = 0
        self.in_flight: set[int] = set()  # draw indices of groups not yet consumed (running, or waiting in `ready`)
        self.batches_written = 0  # by this process (a resumed run's first batch is again the one the trainer awaits)
        # throughput of this process's life (a resumed run starts counting again)
        self.generation_started = time.monotonic()
        self.rollouts_this_run = 0
        self.sampled_tokens_this_run = 0

    async def run(self) -> None:
        workers = worker_count(self.cfg.workers)
        async with open_groups(RolloutSetup.from_config(self.cfg), workers, str(self.run_dir.resolve())) as self.groups:
            await self._serve()

    async def _serve(self) -> None:
        cfg = self.cfg
        if self.progress.next_step:
            log.info("resuming at step %d (%d tasks drawn so far, %d of them drawn again first: their groups were in "
                     "flight)", self.progress.next_step, self.progress.tasks_drawn, len(self.progress.tasks_in_flight))
        urls = cfg.client.urls
        self.tasks = task_sampler(cfg.sampler, self.groups.env.taskset, cfg.seed, self.progress.tasks_drawn,
                                  self.progress.tasks_in_flight, self.progress.sampler)
        log.info(
            "env %s (%s tasks), %d tasks x %d rollouts per step, seq_len %d, %d trainer rank(s), max_async_steps %d, "
            "off-policy limit %d, %s, %d inference server(s)",
            cfg.env.id, len(self.tasks) or "unbounded", cfg.batch.tasks_per_step, cfg.batch.group_size,
            cfg.batch.seq_len, cfg.batch.num_ranks, cfg.max_async_steps, cfg.off_policy_limit,
            self.algorithm.description, len(urls),
        )
        token = cfg.admin_token.get_secret_value() if cfg.admin_token is not None else None
        async with InferencePool(
            urls, admin_token=token, request_timeout_s=cfg.client.request_timeout_s, retry_s=cfg.client.retry_s
        ) as pool:
            self.pool = pool
            self.policy = PolicyTracker(pool, self.run_dir, cfg.weights_poll_s)
            await pool.wait_until_serving(cfg.client.startup_timeout_s)
            await self.algorithm.start()
            await self.policy.load_newest()
            log.info("inference serves policy version %d", self.policy.version)
            watcher = asyncio.create_task(self.policy.watch(), name="weights-watcher")
            self.generation_started = time.monotonic()
            self.stats = self._new_step_stats()
            try:
                await self._steps(watcher)
            finally:
                watcher.cancel()
                for task in self.pending:
                    task.cancel()
                await asyncio.gather(watcher, *self.pending, return_exceptions=True)
                await self.algorithm.close()

    async def _steps(self, watcher: asyncio.Task) -> None:
        max_steps = self.cfg.max_steps
        while max_steps is None or self.progress.next_step < max_steps:
            self._launch()
            if self._take_fresh_groups() is not None:
                continue
            self.policy.changed.clear()
            changed = asyncio.create_task(self.policy.changed.wait())
            idle = not self.pending
            waited = time.monotonic()
            done, _ = await asyncio.wait({*self.pending, changed, watcher, self.groups.failed},
                                         return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if idle:
                self.stats.wait_for_policy_s += time.monotonic() - waited
            if watcher in done:
                watcher.result()  # re-raises what stopped it
                raise RuntimeError("the weights watcher stopped")
            if self.groups.failed in done:
                self.groups.failed.result()  # a worker process died: raises why
            for task in done & self.pending:
                self.pending.discard(task)
                self._collect(task.result())

    def _launch(self) -> None:
        cfg = self.cfg.batch
        budget = self.bound.launch_budget(
            self.policy.version, self.progress.next_step, cfg.tasks_per_step, len(self.pending), len(self.ready),
            cfg.max_concurrent_groups, first_batch=not self.batches_written,
        )
        if self.max_steps_left is not None:  # never start groups for steps the run will not have
            budget = min(budget, max(0, self.max_steps_left * cfg.tasks_per_step - len(self.pending) - len(self.ready)))
        for _ in range(budget):
            draw, task = self.tasks.next()
            self.in_flight.add(draw)
            self.pending.add(asyncio.create_task(self._run_group(draw, task)))

    @property
    def max_steps_left(self) -> int | None:
        return None if self.cfg.max_steps is None else self.cfg.max_steps - self.progress.next_step

    async def _run_group(self, draw: int, task: Any) -> Group:
        started = time.monotonic()
        with self.pool.acquire() as server:
            samples = await self.groups.run(draw, task, server.url)
        teacher = await self.algorithm.teacher_logprobs(samples)
        group = score_group(verifiers_bridge.task_id(task), samples, self.algorithm.scorer, time.monotonic() - started, teacher)
        group.draw = draw
        return group

    def _collect(self, group: Group) -> None:
        self.tasks.observe(group)
        self.progress.rollouts += len(group.rewards)
        self.rollouts_this_run += len(group.rewards)
        if group.failed:
            self.in_flight.discard(group.draw)
            self.stats.unused_groups.append(group)
            self.failed_in_a_row += 1
            error = verifiers_bridge.one_line(next((s.error for s in group.samples if s.error), "unknown error"))
            log.warning("every rollout of task %s failed: %s", group.task_id, error)
            if self.failed_in_a_row >= MAX_FAILED_GROUPS_IN_A_ROW:
                raise RolloutsFailing(f"{self.failed_in_a_row} groups in a row failed entirely; last error: {error}")
            return
        self.failed_in_a_row = 0
        dropped_by = self.algorithm.filters.dropping(group)
        if dropped_by and self.extra_groups_used < self.max_extra_groups:
            self.extra_groups_used += 1
            self.in_flight.discard(group.draw)
            self.stats.unused_groups.append(group)
            self.stats.groups_dropped[dropped_by] = self.stats.groups_dropped.get(dropped_by, 0) + 1
            if dropped_by == "zero_advantage":
                self.progress.groups_dropped_zero_advantage += 1
            return
        self.ready.append(group)

    def _take_fresh_groups(self) -> int | None:
        """Drop stale samples from the waiting groups; once the `tasks_per_step` earliest-drawn groups not yet used
        or dropped have all finished, write them as the next step's batch (in draw order) and return its step number.
        Steps follow the draw order, not the order groups finish in: the same tasks make the same steps in every run
        and after a resume, at the cost of waiting for a slow group while later ones are done."""
        step = self.progress.next_step
        for group in list(self.ready):
            fresh = [s for s in group.samples if self.bound.is_fresh(step, s.policy_versions[0])]
            stale = len(group.samples) - len(fresh)
            if stale:
                self.stats.samples_dropped_off_policy += stale
                self.progress.samples_dropped_off_policy += stale
                group.samples = fresh
                group.score(self.algorithm.scorer)
                if not fresh:
                    self.ready.remove(group)
                    self.in_flight.discard(group.draw)
        earliest = sorted(self.in_flight)[: self.cfg.batch.tasks_per_step]
        finished = {group.draw: group for group in self.ready}
        if len(earliest) < self.cfg.batch.tasks_per_step or not all(draw in finished for draw in earliest):
            return None
        groups = [finished[draw] for draw in earliest]
        for group in groups:
            self.ready.remove(group)
        self._write(step, groups)
        return step

    def _write(self, step: int, groups: list[Group]) -> None:
        cfg = self.cfg
        scored = [(s, a) for g in groups for s, a in zip(g.samples, g.sample_advantages, strict=True)
                  if s.trace_id in g.advantages and trainable(s)]
        # A sample longer than a row would be cut and trained with the reward of the whole rollout: left out, counted.
        samples = [to_batch_sample(s, a) for s, a in scored if len(s.input_ids) <= cfg.batch.seq_len]
        self.stats.samples_too_long = len(scored) - len(samples)
        if not samples:
            raise RuntimeError(
                f"step {step}: no rollout produced a trainable sample (see the errors above; "
                f"{self.stats.samples_too_long} were longer than seq_len {cfg.batch.seq_len})"
            )
        self.in_flight.difference_update(g.draw for g in groups)
        in_flight = sorted(self.in_flight.union(self.tasks.redo_left))
        after = Progress(**{**asdict(self.progress), "next_step": step + 1, "tasks_drawn": self.tasks.drawn,
                            "tasks_in_flight": in_flight, "sampler": self.tasks.state(in_flight)})
        write_started = time.monotonic()
        path = batches.write_batch(
            self.run_dir, step, samples, seq_len=cfg.batch.seq_len, num_ranks=cfg.batch.num_ranks,
            temperature=cfg.sampling.temperature, share_prefixes=bool(cfg.batch.share_prompts),
            extra={"tasks": [g.task_id for g in groups], "progress": asdict(after)},  # what a resume continues from
        )
        meta = json.loads((path / batches.META_FILE).read_text())
        write_s = time.monotonic() - write_started
        self.progress = after
        self.batches_written += 1
        if self.progress.next_step % cfg.ckpt.interval == 0 or self.progress.next_step == cfg.max_steps:
            save_progress(self.run_dir, self.progress, cfg.ckpt.keep_last)
        record = self._step_metrics(step, groups, samples, meta, write_s)
        # Logged under the training step that consumes the batch (the trainer's record of it has the same step).
        self.metrics.log(step + 1, {"rollout_step": step, **record})
        log.info(
            "step %d (rollouts/step_%d): reward %.4f (batch %.4f), %d samples, lag %s, %.1fs",
            step + 1, step, record["reward_mean"], record["batch_reward_mean"], len(samples),
            record["policy_lag_max"], record["step_s"],
        )
        self.stats = self._new_step_stats()
        self.extra_groups_used = 0

    def _new_step_stats(self) -> StepStats:
        return StepStats(workers_cpu_started=None if self.groups is None else self.groups.cpu_s)

    def _workers_cpu_since(self, stats: StepStats) -> float | None:
        """CPU seconds the worker processes spent on this step's groups (None: no workers)."""
        if stats.workers_cpu_started is None or self.groups.cpu_s is None:
            return None
        return self.groups.cpu_s - stats.workers_cpu_started

    def _step_metrics(self, step: int, groups: list[Group], samples: list[batches.Sample], meta: dict,
                      write_s: float) -> dict[str, Any]:
        self.sampled_tokens_this_run += sum(sum(s.loss_mask) for s in samples)
        return step_metrics(
            step, groups, samples, meta, self.stats, write_s=write_s, filter_names=self.algorithm.filters.names,
            policy_version=self.policy.version, weight_update_s=self.policy.last_update_s,
            workers_cpu_s=self._workers_cpu_since(self.stats), rollouts_this_run=self.rollouts_this_run,
            sampled_tokens_this_run=self.sampled_tokens_this_run,
            generation_s=time.monotonic() - self.generation_started, rollouts_total=self.progress.rollouts,
            algorithm_metrics=self.algorithm.step_metrics(groups), sampler_metrics=self.tasks.metrics(),
        )

def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv(OrchestratorConfig, argv, prog="primerl orchestrator")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    quiet_libraries()
    try:
        asyncio.run(Orchestrator(cfg).run())
    except KeyboardInterrupt:
        log.info("interrupted")
        return 130
    except verifiers_bridge.EnvConfigError as e:
        log.error("config error: %s", e)
        return 2
    except (RolloutsFailing, WorkerFailed) as e:
        log.error("orchestrator failed: %s", e)
        return 1
    except Exception as e:
        if (line := storage_failure(e)) is not None:
            print(f"primerl orchestrator: {line}", file=sys.stderr, flush=True)
            return 1
        log.exception("orchestrator failed")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
