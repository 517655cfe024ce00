"""The teacher of on-policy distillation: an inference server (any model primerl serves) that scores the student's
sampled token sequences.

Contract: `Teacher.logprobs(token_ids)` sends the whole sequence (prompt and completion) to the teacher's token route
`POST /inference/v1/generate` with `sampling_params = {"max_tokens": 0, "prompt_logprobs": 0}` and returns one
log-prob per token, aligned with the token itself as a batch's `inference_logprobs` are: entry i is log p_teacher(
token i | tokens before it), the first entry 0.0 (nothing precedes it). The teacher's distribution is its untempered
softmax. Requests are retried through dropped connections (scoring is idempotent), at most `max_concurrent_requests`
in flight; any other failure is one error naming the teacher.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from primerl.config.algorithms import TeacherSection
from primerl.orchestrator.client import build_http, poll_until_ok, with_retries


class TeacherError(RuntimeError):
    """The teacher server answered with an error or with something that is not a scoring of the tokens sent."""


class Teacher:
    def __init__(self, cfg: TeacherSection, request_timeout_s: float, retry_s: float):
        if not cfg.base_url or not cfg.model:
            raise ValueError("the teacher needs teacher.base_url and teacher.model")
        self.url = cfg.base_url.rstrip("/")
        self.model = cfg.model
        self.retry_s = retry_s
        self.http = build_http(self.url, request_timeout_s)
        self._slots = asyncio.Semaphore(cfg.max_concurrent_requests)

    async def close(self) -> None:
        await self.http.aclose()

    async def wait_until_serving(self, timeout_s: float) -> None:
        await poll_until_ok(self.http, "/health", timeout_s, f"the teacher at {self.url} did not answer /health")

    async def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        body = {"model": self.model, "token_ids": list(token_ids),
                "sampling_params": {"max_tokens": 0, "prompt_logprobs": 0}}
        what = f"POST {self.url}/inference/v1/generate (teacher)"
        async with self._slots:
            response = await with_retries(lambda: self.http.post("/inference/v1/generate", json=body), what,
                                          self.retry_s)
        if response.status_code != 200:
            raise TeacherError(f"{what}: {response.status_code} {response.text[:300]}")
        return prompt_logprobs_of(response.json(), token_ids, what)

    async def score(self, samples: Sequence[Any]) -> dict[int, list[float]]:
        """The teacher's log-probs of every sample that has sampled tokens and no error, by `id(sample)`."""
        wanted = [s for s in samples if s.error is None and s.input_ids and any(s.loss_mask)]
        scores = await asyncio.gather(*(self.logprobs(s.input_ids) for s in wanted))
        return {id(s): lp for s, lp in zip(wanted, scores, strict=True)}


def prompt_logprobs_of(response: dict[str, Any], token_ids: Sequence[int], what: str) -> list[float]:
    """Entry i of the response's `prompt_logprobs` (None, or {"<token id>": {"logprob": x, ...}, ...}) for token i."""
    entries = response.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise TeacherError(f"{what}: expected prompt_logprobs for {len(token_ids)} tokens, got {got}")
    out = [0.0]
    for index in range(1, len(token_ids)):
        entry = (entries[index] or {}).get(str(token_ids[index]))
        if entry is None:
            raise TeacherError(f"{what}: no log-prob for token {index} (id {token_ids[index]})")
        out.append(float(entry["logprob"]))
    return out
