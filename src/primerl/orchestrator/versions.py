"""Which policy version sampled each token of a rollout: read from the token route's answers, looked up per turn.

primerl's server answers every `/inference/v1/generate` choice with `token_policy_versions` (the version that
sampled each token). verifiers' renderer client keeps only a turn's token ids and logprobs, so the model clients the
orchestrator builds (`client.install_model_client_transport`) hand every token-route answer to `TOKEN_VERSIONS`,
which keeps each completion's versions, as runs, under a hash of the completion's (token ids, logprobs), exactly what
a trace's sampled node holds; the bridge looks each sampled node up there when it turns an episode into samples and
then forgets the entries it used. A completion the ledger does not know (another server, an entry already evicted)
has no versions; its sample falls back to the versions the bridge read from the server around the group.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import httpx

TOKEN_ROUTE = "/inference/v1/generate"
CAPACITY = 16384
"""Completions kept at most (a few dozen bytes each): more than the turns of the rollouts in flight; when full, the
oldest go first."""

Runs = list[tuple[int, int]]


def segments(versions: Sequence[int]) -> Runs:
    """Run-length form of per-token versions: [(version, number of consecutive tokens), ...] in token order."""
    return join([(version, 1) for version in versions])


def join(runs: Iterable[tuple[int, int]]) -> Runs:
    """`runs` with neighbours of the same version merged."""
    joined: Runs = []
    for version, count in runs:
        if joined and joined[-1][0] == version:
            joined[-1] = (version, joined[-1][1] + count)
        else:
            joined.append((version, count))
    return joined


def completion_key(token_ids: Sequence[int], logprobs: Sequence[float]) -> int:
    return hash((tuple(token_ids), tuple(logprobs)))


class TokenVersionLedger:
    """Per-token versions (as runs) of recent token-route completions, keyed by `completion_key`."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, Runs] = OrderedDict()

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
            key = completion_key(token_ids, [float(entry["logprob"]) for entry in content])
            self._entries[key] = segments(versions)
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

    def lookup(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> Runs | None:
        """The version runs of the completion `token_ids` sampled with `logprobs`, None when not recorded."""
        return self._entries.get(completion_key(token_ids, logprobs))

    def forget(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._entries.pop(key, None)


TOKEN_VERSIONS = TokenVersionLedger()
"""The ledger of this process's model clients (see the module docstring)."""
