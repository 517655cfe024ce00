"""Which policy version sampled each token of a rollout: read from the token route's answers, looked up per turn.

primerl's server answers every `/inference/v1/generate` choice with `token_policy_versions` (the version that
sampled each token). verifiers' renderer client keeps only a turn's token ids and logprobs, so the model clients the
orchestrator builds (`client.install_model_client_transport`) hand every token-route answer to `TOKEN_VERSIONS`,
which keeps each completion's versions under the completion's (token ids, logprobs), exactly what a trace's sampled
node holds; the bridge looks each sampled node up there when it turns an episode into samples. A completion the
ledger does not know (another server, an entry already evicted) has no versions; its sample falls back to the
versions the bridge read from the server around the group.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import httpx

TOKEN_ROUTE = "/inference/v1/generate"
CAPACITY = 65536
"""Completions kept at most; more than the turns of the rollouts in flight, the oldest go first."""

Key = tuple[tuple[int, ...], tuple[float, ...]]


def segments(versions: Sequence[int]) -> list[tuple[int, int]]:
    """Run-length form of per-token versions: [(version, number of consecutive tokens), ...] in token order."""
    runs: list[tuple[int, int]] = []
    for version in versions:
        if runs and runs[-1][0] == version:
            runs[-1] = (version, runs[-1][1] + 1)
        else:
            runs.append((version, 1))
    return runs


class TokenVersionLedger:
    """Per-token versions of recent token-route completions, keyed by (token ids, logprobs)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Key, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, body: dict) -> None:
        """Keep the versions of every choice of a token-route answer that carries them (and logprobs)."""
        for choice in body.get("choices") or []:
            versions = choice.get("token_policy_versions")
            content = (choice.get("logprobs") or {}).get("content")
            token_ids = choice.get("token_ids")
            if versions is None or content is None or token_ids is None or not token_ids:
                continue
            if not len(versions) == len(content) == len(token_ids):
                continue
            key = (tuple(token_ids), tuple(float(entry["logprob"]) for entry in content))
            self._entries[key] = list(versions)
            self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    async def on_response(self, response: httpx.Response) -> None:
        """httpx response hook: record a successful token-route answer (its body stays readable for the caller)."""
        if response.request.method != "POST" or not response.request.url.path.endswith(TOKEN_ROUTE):
            return
        if response.status_code != 200:
            return
        await response.aread()
        try:
            self.record(json.loads(response.content))
        except (ValueError, TypeError, KeyError, AttributeError):
            return  # not primerl's answer shape: the renderer client reports what is wrong with it

    def lookup(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> list[int] | None:
        return self._entries.get((tuple(token_ids), tuple(logprobs)))

    def forget(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self._entries.pop(key, None)


TOKEN_VERSIONS = TokenVersionLedger()
"""The ledger of this process's model clients (see the module docstring)."""
