"""Running one group (a task's `group_size` rollouts) in this process: what the orchestrator's loop does with
`workers = 0`, and what each worker process does (`primerl.orchestrator.workers`).

Contract: `GroupRunner(setup)` is built from a `RolloutSetup` (plain, picklable data: the same setup gives the same
rollouts in any process) inside a running event loop; `async with runner:` loads the environment and serves its
interception server; `await runner.run(draw, task, url)` returns the samples of the task drawn `draw`-th, sampled
from the server at `url` (as the orchestrator's `InferencePool` names it) with the seeds `rollout_seed(seed, draw,
i)`. The runner owns what a rollout needs from its process: the model clients' transport and timeout, the
token-version ledger they fill (`versions.TOKEN_VERSIONS`), the renderer pool, and a `GET /health` client per server
for the version bracket. `runner.env` is the loaded environment (its taskset is what the loop draws from). `cpu_s` is
None (groups cost the caller's own CPU) and `failed` never completes (a group's failure is its own exception): the
two are what a `workers.WorkerPool` reports of its processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Self

import verifiers.v1 as vf

from primerl.config.orchestrator import EnvSection, OrchestratorConfig
from primerl.models import resolve_model
from primerl.orchestrator import verifiers_bridge
from primerl.orchestrator.client import InferencePool, install_model_client_transport
from primerl.orchestrator.pydantic_speedup import cache_default_factory_checks

NOISY_LIBRARIES = ("httpx", "httpcore", "aiohttp.access", "verifiers.v1.rollout")


def quiet_libraries() -> None:
    """Log only warnings and errors of the libraries that log every request (the orchestrator's and its workers')."""
    for name in NOISY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING)


@dataclass(frozen=True)
class RolloutSetup:
    """Everything a process needs to run groups for an orchestrator (sent to each worker process)."""

    env: EnvSection
    renderer_model: str
    """The model directory whose tokenizer and chat template render prompts."""
    model_name: str
    """The name the servers serve the policy as."""
    urls: tuple[str, ...]
    sampling: dict[str, Any]
    """verifiers `SamplingConfig` fields."""
    group_size: int
    seed: int
    request_timeout_s: float
    retry_s: float

    @classmethod
    def from_config(cls, cfg: OrchestratorConfig) -> RolloutSetup:
        return cls(
            env=cfg.env,
            renderer_model=str(resolve_model(cfg.model.name, cfg.model.revision)),
            model_name=cfg.served_model_name or cfg.model.name,
            urls=tuple(cfg.client.urls),
            sampling=cfg.sampling.verifiers_fields(),
            group_size=cfg.batch.group_size,
            seed=cfg.seed,
            request_timeout_s=cfg.client.request_timeout_s,
            retry_s=cfg.client.retry_s,
        )


class GroupRunner:
    """Runs groups in this process's event loop (see the module docstring)."""

    cpu_s: float | None = None

    def __init__(self, setup: RolloutSetup):
        self.setup = setup
        install_model_client_transport(setup.request_timeout_s)
        cache_default_factory_checks()
        urls = [url.rstrip("/") for url in setup.urls]
        self.clients = {url: verifiers_bridge.train_client(url, renderer_model=setup.renderer_model) for url in urls}
        # Building a client schedules loading the tokenizer (slow) on a thread: it loads while the environment
        # loads and the server comes up.
        self._warm_client = vf.resolve_client(self.clients[urls[0]])
        self.sampling = vf.SamplingConfig(**setup.sampling)
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.env: vf.Env | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Self:
        await asyncio.sleep(0)  # the tokenizer's thread starts now
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self._warm_client.close)
            self.env = verifiers_bridge.env_from_config(self.setup.env)
            self.pool = await stack.enter_async_context(InferencePool(
                list(self.clients), admin_token=None, request_timeout_s=self.setup.request_timeout_s,
                retry_s=self.setup.retry_s,
            ))
            self._servers = {server.url: server for server in self.pool.servers}
            await stack.enter_async_context(self.env.serving())
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def run(self, draw: int, task: Any, url: str) -> list[verifiers_bridge.RolloutSample]:
        server = self._servers[url]

        async def current_version() -> int:
            return int((await self.pool.health(server))["policy_version"])

        n, seed = self.setup.group_size, self.setup.seed
        return await verifiers_bridge.run_group(
            self.env, task, n, model=self.setup.model_name, client=self.clients[url], sampling=self.sampling,
            current_version=current_version, seeds=[verifiers_bridge.rollout_seed(seed, draw, i) for i in range(n)],
        )
