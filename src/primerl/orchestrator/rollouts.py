"""The verifiers bridge: run rollouts of an environment against the inference server and return training samples.

Rollouts go through verifiers' own machinery (`Env.run_episode`: taskset task -> agents -> rollout -> interception ->
client -> scoring) with each environment's in-process `ChatHarness` (see `envkit`). With the renderer client
(`train_client`) every model call is rendered to token ids here and sent to the server's `/inference/v1/generate`, so
each trace branch carries its exact token sequence, which tokens the model sampled, and their sampling logprobs; with
the chat client (`chat_client`) calls go through `/v1/chat/completions` and samples carry rewards but no tokens (eval).

Policy versions: the server reports them per choice, but the renderer client keeps only token ids and logprobs, so
the bridge brackets each group with the server's current version (`current_version`, e.g. `GET /health`) before its
first rollout starts and after its last one ends: two calls per group, not per rollout. Versions only grow, so
`[before, after]` contains every version that sampled the group's tokens; it is exact whenever no weight update
landed while the group ran.

    env = load_env("reverse-text")
    client = train_client("http://127.0.0.1:8000", renderer_model=model_dir)
    async with env.serving():
        samples = await run_group(env, task, n=8, model="tiny", client=client, sampling=vf.SamplingConfig(...),
                                  current_version=lambda: policy_version(http))
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import verifiers.v1 as vf
from renderers import RendererConfig


@dataclass(frozen=True)
class Sample:
    """One training sample: a root-to-leaf token path of one rollout (single-turn and most multi-turn rollouts have
    exactly one; a rollout whose prompt re-rendering diverged from the sampled tokens has one per path).

    Token fields are aligned and empty for rollouts that carry no tokens (chat client, or a rollout that failed
    before its first model call)."""

    env: str
    """Environment id the rollout came from."""
    task_id: str | None
    """The task's durable id (`TaskData.id`)."""
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
    """(oldest, newest) weight version that may have sampled these tokens; see the module docstring."""
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

    @property
    def completion_len(self) -> int:
        """Tokens from the first sampled token to the end (later user/tool turns included)."""
        return len(self.input_ids) - self.prompt_len

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask)


def load_env(env_id: str, *, agent: dict[str, Any] | None = None, **taskset_args: Any) -> vf.Env:
    """The environment installed under `env_id` (e.g. `reverse-text`), resolved the way verifiers resolves it: the
    taskset package, its `Env` (or the single-agent env) and its default harness. Every agent role runs in the local
    subprocess runtime (in-process harnesses never start a process in it); `agent` overrides each role's
    `vf.AgentConfig` fields (e.g. `{"max_turns": 4}`); `taskset_args` are the taskset's config fields."""
    role_names = [
        name
        for name, info in vf.env_config_type(env_id).model_fields.items()
        if isinstance(info.default, vf.AgentConfig)
    ]
    role = {"runtime": {"type": "subprocess"}, **(agent or {})}
    config = vf.resolve_env_config({"taskset": {"id": env_id, **taskset_args}, **dict.fromkeys(role_names, role)})
    return vf.load_environment(config)


def train_client(
    server_url: str, renderer_model: str | Path, renderer: RendererConfig | None = None
) -> vf.TrainClientConfig:
    """The renderer client for a primerl server at `server_url` (scheme://host:port). `renderer_model` is the model
    directory whose tokenizer and chat template render prompts (the served model's own); `renderer` picks the
    renderer (None: auto-detected from the model, which falls back to the chat template without tool parsing)."""
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


async def run_group(
    env: vf.Env,
    task: vf.Task,
    n: int,
    *,
    model: str,
    client: vf.TrainClientConfig | vf.EvalClientConfig,
    sampling: vf.SamplingConfig,
    current_version: Callable[[], Awaitable[int]],
) -> list[Sample]:
    """Run `n` independent rollouts of `task` concurrently and return their samples (at least one per rollout).
    Call inside `async with env.serving():` so rollouts share the env's interception server. `current_version`
    returns the policy version the server samples with now (called once before and once after the group)."""
    ctx = vf.ModelContext(model=model, client=client, sampling=sampling)
    before = await current_version()
    episodes = await asyncio.gather(*(env.run_episode(task, ctx) for _ in range(n)))
    versions = (before, await current_version())
    return [sample for episode in episodes for sample in samples_from_episode(episode, versions)]


def samples_from_episode(episode: vf.Episode, policy_versions: tuple[int, int]) -> list[Sample]:
    """The training samples of a finished episode: one per trainable branch of each trainable trace (one empty
    sample for a trace without branches, so a failed rollout still reports its reward and error)."""
    samples = []
    for trace in episode.traces:
        if not trace.agent.trainable:
            continue
        common: dict[str, Any] = {
            "env": episode.env.id,
            "task_id": trace.task.data.id,
            "trace_id": trace.id,
            "reward": trace.reward,
            "rewards": {name: r.score for name, r in trace.rewards.items() if r is not None},
            "metrics": {name: m for name, m in trace.metrics.items() if m is not None},
            "policy_versions": policy_versions,
            "num_turns": trace.num_turns,
            "is_truncated": trace.is_truncated,
            "stop_condition": trace.stop_condition,
            "error": f"{trace.last_error.type}: {trace.last_error.message}" if trace.last_error else None,
        }
        branches = [branch for branch in trace.branches if branch.trainable]
        if not branches:
            samples.append(Sample(input_ids=[], loss_mask=[], inference_logprobs=[], prompt_len=0, **common))
        for branch in branches:
            mask = [int(sampled) for sampled in branch.sampled_mask]
            samples.append(
                Sample(
                    input_ids=branch.token_ids,
                    loss_mask=mask,
                    inference_logprobs=branch.logprobs,
                    prompt_len=mask.index(1) if 1 in mask else len(mask),
                    **common,
                )
            )
    return samples
