"""Per-token policy versions through the token route, on the embedded engine: a weight update that lands while a
completion is being sampled splits its tokens between two versions, the answer says which token came from which,
verifiers' renderer client still parses it, and the orchestrator's ledger keys it the way a trace keeps the turn."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from renderers.client import _parse_completion_logprobs

from primerl.config.inference import InferenceConfig
from primerl.inference.admin import Admin
from primerl.inference.completions import Completions
from primerl.inference.engines.base import TokenEvent
from primerl.inference.engines.hf import HFEngine
from primerl.inference.protocol import GenerateRequest, UpdateWeightsRequest
from primerl.orchestrator.versions import TokenVersionLedger, completion_key, segments

MAX_TOKENS = 256


def tap_first_token(engine: HFEngine) -> asyncio.Event:
    """An event set when the engine delivers its first sampled token to any request (the engine is unchanged; its
    streams are observed on their way to the server)."""
    seen = asyncio.Event()
    generate = engine.generate

    def observed(prompt_ids, params, request_id):
        stream = generate(prompt_ids, params, request_id)

        async def events():
            async for event in stream:
                if isinstance(event, TokenEvent):
                    seen.set()
                yield event

        return events()

    engine.generate = observed  # type: ignore[method-assign]
    return seen


def test_an_update_mid_completion_splits_its_tokens_between_versions(tiny_model_dir: Path, tmp_path: Path,
                                                                      perturbed_tiny_model):
    new_weights = perturbed_tiny_model(tmp_path / "step_1", scale=0.05)

    async def main() -> dict:
        engine = HFEngine(tiny_model_dir, model_name="tiny", max_batch_size=4, decode_steps=1)
        cfg = InferenceConfig(admin_token="test-token", served_model_name="tiny")
        completions, admin = Completions(engine, cfg), Admin(engine, cfg)
        await engine.start()
        try:
            first_token = tap_first_token(engine)
            request = GenerateRequest(
                model="tiny", token_ids=[1, 17, 45, 300],
                sampling_params={"max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True, "logprobs": 1},
            )
            answer = asyncio.create_task(completions.generate(request))
            await first_token.wait()
            await engine.pause()  # between two decode steps, with tokens of version 0 already sampled
            await admin.update_weights(UpdateWeightsRequest(path=str(new_weights), step=1))
            await engine.resume()
            return json.loads((await answer).body)
        finally:
            await engine.stop()

    body = asyncio.run(main())
    choice = body["choices"][0]
    versions = choice["token_policy_versions"]
    assert len(versions) == len(choice["token_ids"]) == MAX_TOKENS
    switch = versions.index(1)
    assert switch >= 1 and set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
    assert choice["policy_versions"] == [0, 1]

    logprobs = _parse_completion_logprobs(choice, choice["token_ids"])  # what the renderer client keeps
    ledger = TokenVersionLedger()
    ledger.record(body)
    assert ledger.lookup(choice["token_ids"], logprobs) == segments(versions) == [(0, switch), (1, MAX_TOKENS - switch)]
    assert ledger.lookup(choice["token_ids"], [lp + 1.0 for lp in logprobs]) is None


def test_ledger_keeps_the_newest_completions_only():
    ledger = TokenVersionLedger(capacity=2)
    for i in range(3):
        ledger.record({"choices": [{"token_ids": [i], "token_policy_versions": [i],
                                    "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": -1.0}]}}]})
    assert len(ledger) == 2
    assert ledger.lookup([0], [-1.0]) is None and ledger.lookup([2], [-1.0]) == [(2, 1)]
    ledger.forget([completion_key([2], [-1.0])])
    assert ledger.lookup([2], [-1.0]) is None and len(ledger) == 1
