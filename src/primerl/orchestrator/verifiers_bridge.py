"""The verifiers bridge: run rollouts of an environment against the inference server and return training samples.

Rollouts go through verifiers' own machinery (`Env.run_episode`: taskset task -> agents -> rollout -> interception ->
client -> scoring) with each environment's in-process `ChatHarness` (see `envkit`). With the renderer client
(`train_client`) every model call is rendered to token ids here and sent to the server's `/inference/v1/generate`, so
each trace branch carries its exact token sequence, which tokens the model sampled, and their sampling logprobs; with
the chat client (`chat_client`) calls go through `/v1/chat/completions` and samples carry rewards but no tokens (eval).

Policy versions: the server reports the version that sampled each token; the renderer client keeps only token ids
and logprobs, so the orchestrator's model clients record each answer's versions (`versions.TOKEN_VERSIONS`) and the
bridge looks every sampled turn up there: a sample's `version_segments` say which of its sampled tokens came from
which version, and `policy_versions` is their (oldest, newest). As a fallback for turns the ledger does not know, the
bridge also brackets each group with the server's current version (`current_version`, e.g. `GET /health`) before
its first rollout starts and after its last one ends; versions only grow, so `[before, after]` bounds them.

    env = load_env("reverse-text")
    client = train_client("http://127.0.0.1:8000", renderer_model=model_dir)
    async with env.serving():
        samples = await run_group(env, task, n=8, model="tiny", client=client, sampling=vf.SamplingConfig(...),
                                  current_version=lambda: policy_version(http))
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pydantic
import verifiers.v1 as vf
from renderers import RendererConfig
from verifiers.v1.utils.loaders import harness_class

from primerl.orchestrator.tokenizer import chat_template_renderer, install_renderer_tokenizer_loader
from primerl.orchestrator.versions import TOKEN_VERSIONS, Runs, TokenVersionLedger, completion_key, join


@dataclass(frozen=True)
class RolloutSample:
    """One training sample: a root-to-leaf token path of one rollout (single-turn and most multi-turn rollouts have
    exactly one; a rollout whose prompt re-rendering diverged from the sampled tokens has one per path).

    Token fields are aligned and empty for rollouts that carry no tokens (chat client, or a rollout that failed
    before its first model call)."""

    env: str
    """Environment id the rollout came from."""
    task_id: str
    """The task's stable id (`task_id`: its durable `TaskData.id`, else its content key)."""
    trace_id: str
    """The verifiers trace this sample was cut from (several samples may share one)."""
    input_ids: list[int]
    """Prompt and every later turn, as the model saw and produced them."""
    loss_mask: list[int]
    """1 on tokens the model sampled, 0 on prompt, template, user and tool tokens."""
    inference_logprobs: list[float]
    """Sampling logprob of each sampled token; 0.0 on unsampled positions."""
    prompt_len: int
    """Tokens before the first sampled token."""
    reward: float
    """Weighted sum of the task's rewards."""
    rewards: dict[str, float]
    """Each named reward component (unweighted scores)."""
    policy_versions: tuple[int, int]
    """(oldest, newest) weight version that sampled these tokens (the group's bracket when `version_segments` is
    empty); see the module docstring."""
    num_turns: int
    """Model turns in the rollout."""
    is_truncated: bool
    """A turn hit its token limit or the rollout hit a turn/token cap."""
    stop_condition: str | None
    """What ended the rollout (`agent_completed`, `user_closed`, `max_turns`, an error kind, ...)."""
    error: str | None
    """The rollout's last error, when it failed."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The task's and harness's metrics."""
    version_segments: tuple[tuple[int, int], ...] = ()
    """(policy version, number of tokens) runs over the sampled tokens in order; empty when not known."""
    generated_tokens: int | None = None
    """Tokens the model generated in the rollout, as the server reported them (its usage); None when not reported."""

    @property
    def completion_len(self) -> int:
        """Tokens from the first sampled token to the end (later user/tool turns included)."""
        return len(self.input_ids) - self.prompt_len

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask)


DEFAULT_HARNESS = "primerl-chat"
"""The harness of a taskset that ships none: `envkit.ChatHarness`, in-process (verifiers alone would pick `bash`)."""
UNSANDBOXED_FLAG = "env.allow_unsandboxed_tools"


class EnvConfigError(ValueError):
    """The environment's settings (`env.args`, a role's fields, its harness and runtime) cannot be used as given."""


class UnsandboxedToolsError(EnvConfigError):
    """A harness that executes model-directed code was configured to run on the host without a sandbox."""


def _validation_lines(env_id: str, error: pydantic.ValidationError) -> str:
    """One line per field of a verifiers env config that failed to validate, named as the user set it: a taskset
    field `x` is `env.args.x`."""
    lines = []
    for e in error.errors():
        loc = [str(part) for part in e["loc"]]
        where = ".".join(["env.args", *loc[1:]] if loc[:1] == ["taskset"] else loc) or "env"
        got = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
        lines.append(f"{where}: {e['msg']}{got}")
    return f"environment {env_id!r}: " + "; ".join(lines)


def load_env(
    env_id: str,
    *,
    harness: str | None = None,
    runtime: dict[str, Any] | None = None,
    allow_unsandboxed_tools: bool = False,
    agent: dict[str, Any] | None = None,
    **taskset_args: Any,
) -> vf.Env:
    """The environment installed under `env_id` (e.g. `reverse-text`), resolved the way verifiers resolves it: the
    taskset package and its `Env` (or the single-agent env).

    Each agent role runs `harness` (a harness id) when given; otherwise the harness its env pins, else the taskset's
    own, else `DEFAULT_HARNESS`. Every role runs in `runtime` (a verifiers `RuntimeConfig` as a dict; default the
    local subprocess runtime, in which in-process harnesses start nothing). A harness that gives the model a shell or
    file tools (verifiers' `EXECUTES_CODE`), or that needs a container, is refused on the subprocess runtime with
    `UnsandboxedToolsError` unless `allow_unsandboxed_tools`. `agent` overrides each role's `vf.AgentConfig` fields
    (e.g. `{"max_turns": 4}`); `taskset_args` are the taskset's config fields."""
    roles = {
        name: info.default
        for name, info in vf.env_config_type(env_id).model_fields.items()
        if isinstance(info.default, vf.AgentConfig)
    }
    fallback = harness or (env_id if vf.default_harness_id(env_id) == env_id else DEFAULT_HARNESS)
    common = {"runtime": runtime or {"type": "subprocess"}, **(agent or {})}

    def role(default: vf.AgentConfig) -> dict[str, Any]:
        pinned = default.harness is not None and harness is None
        return common if pinned else {**common, "harness": {"id": fallback}}

    try:
        config = vf.resolve_env_config(
            {"taskset": {"id": env_id, **taskset_args}, **{name: role(default) for name, default in roles.items()}}
        )
    except pydantic.ValidationError as e:
        raise EnvConfigError(_validation_lines(env_id, e)) from None
    if not allow_unsandboxed_tools:
        refuse_unsandboxed(config)
    return vf.load_environment(config)


def refuse_unsandboxed(config: vf.EnvConfig) -> None:
    """Raise `UnsandboxedToolsError` when a role's harness would execute model-directed code on this host."""
    for role, harness_config in config.agent_harnesses().items():
        runtime = getattr(config, role).runtime
        harness = harness_class(harness_config.id)
        if isinstance(runtime, vf.SubprocessConfig) and (harness.EXECUTES_CODE or harness.NEEDS_CONTAINER):
            what = "gives the model a shell or file tools" if harness.EXECUTES_CODE else "needs a container"
            raise UnsandboxedToolsError(
                f"harness {harness_config.id!r} {what} and would run unsandboxed on this host (runtime subprocess): "
                f"use --env.runtime.type docker, or set --{UNSANDBOXED_FLAG} true to run it on this host anyway"
            )


def env_from_config(section: Any) -> vf.Env:
    """`load_env` for a config's `env` section (`primerl.config.orchestrator.EnvSection`)."""
    return load_env(
        section.id,
        harness=section.harness,
        runtime=section.runtime.verifiers_config(),
        allow_unsandboxed_tools=section.allow_unsandboxed_tools,
        **section.args,
    )


def probe_env(section: Any) -> str:
    """Load a config's environment and its first task, as the orchestrator will: what the checklist's `environment`
    step runs (in a child process). Raises `EnvConfigError` for settings the environment refuses."""
    env = env_from_config(section)
    first = next(iter(env.taskset), None)
    if first is None:
        raise EnvConfigError(f"environment {section.id!r} has no tasks with env.args {section.args}")
    args = f" with env.args {section.args}" if section.args else ""
    return f"{section.id}{args}: loaded; first task {task_id(first)}"


def task_id(task: vf.Task) -> str:
    """A task's stable id: its durable `id` when the taskset gives one, else its content key (`Task.key`)."""
    return task.data.id or task.key


def one_line(error: str) -> str:
    """A rollout error on one line, keeping what says why: a harness error carries its program's output (a
    traceback's end), whose last line is the root cause, after the line saying which harness failed."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else error
    head = lines[0].rsplit(": ", 1)[0] if ": " in lines[0] else lines[0]
    return f"{head}: {lines[-1]}"


def train_client(
    server_url: str, renderer_model: str | Path, renderer: RendererConfig | None = None
) -> vf.TrainClientConfig:
    """The renderer client for a primerl server at `server_url` (scheme://host:port). `renderer_model` is the model
    directory whose tokenizer and chat template render prompts (the served model's own); `renderer` picks the
    renderer (None: auto-detected from the model, which falls back to the chat template without tool parsing).
    Its tokenizer and renderer are chosen without importing torch where the model allows it
    (`primerl.orchestrator.tokenizer`)."""
    install_renderer_tokenizer_loader()
    if renderer is None:
        renderer = chat_template_renderer(renderer_model)
    return vf.TrainClientConfig(
        base_url=f"{server_url.rstrip('/')}/v1",
        api_key_var="PRIMERL_API_KEY",
        renderer=renderer,
        renderer_model_name=str(renderer_model),
    )


def chat_client(server_url: str) -> vf.EvalClientConfig:
    """The chat-completions client for a primerl server at `server_url`: tools in, `tool_calls` out, no token ids."""
    return vf.EvalClientConfig(base_url=f"{server_url.rstrip('/')}/v1", api_key_var="PRIMERL_API_KEY")


async def policy_version(http: httpx.AsyncClient) -> int:
    """The weight version the server samples with now."""
    response = await http.get("/health")
    response.raise_for_status()
    return int(response.json()["policy_version"])


def rollout_seed(seed: int, draw: int, rollout: int) -> int:
    """The sampling seed of rollout `rollout` of the task drawn `draw`-th in a run seeded `seed`: the same in every run
    and after a resume, whatever order the requests reach the server in."""
    digest = hashlib.blake2b(f"{seed}:{draw}:{rollout}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # 62 bits: the server adds the sample index for n > 1


async def run_group(
    env: vf.Env,
    task: vf.Task,
    n: int,
    *,
    model: str,
    client: vf.TrainClientConfig | vf.EvalClientConfig,
    sampling: vf.SamplingConfig,
    current_version: Callable[[], Awaitable[int]],
    ledger: TokenVersionLedger = TOKEN_VERSIONS,
    seeds: Sequence[int] | None = None,
) -> list[RolloutSample]:
    """Run `n` independent rollouts of `task` concurrently and return their samples (at least one per rollout).
    Rollout i sends `seeds[i]` with each of its requests (None: the server picks). Call inside `async with
    env.serving():` so rollouts share the env's interception server. `current_version` returns the policy version
    the server samples with now (called once before and once after the group); `ledger` holds the per-token versions
    of the model calls (see the module docstring)."""
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} rollouts")
    contexts = [
        vf.ModelContext(model=model, client=client,
                        sampling=sampling if seeds is None else vf.SamplingConfig(**sampling.model_dump(), seed=seed))
        for seed in (seeds or [None] * n)
    ]
    before = await current_version()
    episodes = await asyncio.gather(*(env.run_episode(task, ctx) for ctx in contexts))
    versions = (before, await current_version())
    used: set = set()
    samples = [sample for episode in episodes for sample in samples_from_episode(episode, versions, ledger, used)]
    ledger.forget(used)
    return samples


def samples_from_episode(
    episode: vf.Episode,
    policy_versions: tuple[int, int],
    ledger: TokenVersionLedger | None = None,
    used: set | None = None,
) -> list[RolloutSample]:
    """The training samples of a finished episode: one per trainable branch of each trainable trace (one empty
    sample for a trace without branches, so a failed rollout still reports its reward and error). Each sampled turn
    is looked up in `ledger` for its per-token versions (the keys found are added to `used`); a branch with a turn
    the ledger does not know gets the bracket `policy_versions`."""
    samples = []
    for trace in episode.traces:
        if not trace.agent.trainable:
            continue
        common: dict[str, Any] = {
            "env": episode.env.id,
            "task_id": task_id(trace.task),
            "trace_id": trace.id,
            "reward": trace.reward,
            "rewards": {name: r.score for name, r in trace.rewards.items() if r is not None},
            "metrics": {name: m for name, m in trace.metrics.items() if m is not None},
            "num_turns": trace.num_turns,
            "is_truncated": trace.is_truncated,
            "stop_condition": trace.stop_condition,
            "error": f"{trace.last_error.type}: {trace.last_error.message}" if trace.last_error else None,
            "generated_tokens": usage.completion_tokens if (usage := trace.usage) is not None else None,
        }
        branches = [branch for branch in trace.branches if branch.trainable]
        if not branches:
            samples.append(RolloutSample(input_ids=[], loss_mask=[], inference_logprobs=[], prompt_len=0,
                                  policy_versions=policy_versions, **common))
        for branch in branches:
            mask = [int(sampled) for sampled in branch.sampled_mask]
            runs = _version_runs(branch, ledger, used) if ledger is not None else None
            versions = [version for version, _ in runs or []]
            samples.append(
                RolloutSample(
                    input_ids=branch.token_ids,
                    loss_mask=mask,
                    inference_logprobs=branch.logprobs,
                    prompt_len=mask.index(1) if 1 in mask else len(mask),
                    policy_versions=(min(versions), max(versions)) if versions else policy_versions,
                    version_segments=tuple(runs or ()),
                    **common,
                )
            )
    return samples


def rollout_records(samples: Sequence[RolloutSample]) -> list[dict[str, Any]]:
    """One record per rollout (per trace; a rollout cut into several samples is counted once), in order: its reward,
    model turns, the taskset's metrics, completion length (its longest sample's), whether it was truncated, what
    stopped it and its error. What `eval` writes per rollout and what the orchestrator's step metrics average over.
    Without token ids (the chat client) the completion length is the tokens the server says it generated (None when
    it says nothing)."""
    by_trace: dict[str, list[RolloutSample]] = {}
    for sample in samples:
        by_trace.setdefault(sample.trace_id, []).append(sample)
    records = []
    for branches in by_trace.values():
        first = branches[0]
        records.append({
            "reward": float(first.reward),
            "turns": first.num_turns,
            "metrics": dict(first.metrics),
            "completion_len": (max(s.completion_len for s in branches) if any(s.input_ids for s in branches)
                               else first.generated_tokens),
            "truncated": any(s.is_truncated for s in branches),
            "stop_condition": first.stop_condition,
            "error": next((one_line(s.error) for s in branches if s.error is not None), None),
        })
    return records


def rollout_means(records: Sequence[Mapping[str, Any]]) -> dict[str, float | int | None]:
    """Per-rollout figures of `rollout_records`: turns, completion length, truncation, and the mean of each of the
    taskset's metrics as `metric/<name>` (over the rollouts that report it)."""
    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    out: dict[str, float | int | None] = {
        "rollouts": len(records),
        "turns_mean": mean([r["turns"] for r in records]),
        "turns_max": max((r["turns"] for r in records), default=None),
        "completion_len_mean": mean(lens := [r["completion_len"] for r in records if r["completion_len"] is not None]),
        "completion_len_max": max(lens, default=None),
        "truncated_frac": mean([float(r["truncated"]) for r in records]),
    }
    names = sorted({name for r in records for name in r["metrics"]})
    for name in names:
        values = [float(v) for r in records if isinstance(v := r["metrics"].get(name), int | float)]
        out[f"metric/{name}"] = mean(values)
    return out


def _version_runs(branch: Any, ledger: TokenVersionLedger, used: set | None) -> Runs | None:
    """The version runs over the sampled tokens of `branch`, in order, or None when a sampled turn is not in
    `ledger`."""
    runs: Runs = []
    for node in branch.nodes:
        if not any(node.mask):
            continue
        sampled = [token for token, is_sampled in zip(node.token_ids, node.mask, strict=True) if is_sampled]
        found = ledger.lookup(sampled, node.logprobs)
        if found is None:
            return None
        if used is not None:
            used.add(completion_key(sampled, node.logprobs))
        runs.extend(found)
    return join(runs)
