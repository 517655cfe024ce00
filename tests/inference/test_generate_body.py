"""The token route's response is built as plain data (`completions.generate_body`, no model object per token); it
must stay exactly what `GenerateResponse`, the route's documented schema, validates and dumps."""

from __future__ import annotations

import json

import pytest

from primerl.inference.completions import CompletionSample, _usage, generate_body
from primerl.inference.engines.base import Finish, TokenEvent
from primerl.inference.protocol import GenerateResponse, PromptLogprob


def sample(tokens: list[tuple[int, float, int]], reason: str) -> CompletionSample:
    out = CompletionSample()
    for token, logprob, version in tokens:
        out.add(TokenEvent(token, logprob, version))
    out.add(Finish(reason, (tokens[0][2], tokens[-1][2]) if tokens else (3, 3), 4, len(tokens)))
    return out


@pytest.mark.parametrize("logprobs", [True, False])
@pytest.mark.parametrize("with_prompt_logprobs", [True, False])
def test_the_plain_body_is_what_the_schema_validates_and_dumps(logprobs: bool, with_prompt_logprobs: bool):
    samples = [sample([(5, -0.25, 1), (9, -1.5, 1), (2, -0.125, 2)], "stop"), sample([], "abort"),
               sample([(7, -3.0, 2)], "length")]
    prompt = [1, 4, 6, 8]
    prompt_logprobs = ([None] + [{str(t): PromptLogprob(logprob=-0.5 * t)} for t in prompt[1:]]
                       if with_prompt_logprobs else None)
    body = generate_body("gen-1", prompt, samples, logprobs, _usage(len(prompt), samples), prompt_logprobs)
    assert GenerateResponse.model_validate(body).model_dump(mode="json") == body
    json.dumps(body, allow_nan=False)  # what the JSON response renders
    first = body["choices"][0]
    assert first["token_policy_versions"] == [1, 1, 2] and first["policy_versions"] == [1, 2]
    assert body["choices"][1]["policy_versions"] == [3]  # no token: the version at the finish
    assert (first["logprobs"] is None) is (not logprobs)
    if logprobs:
        assert first["logprobs"]["content"][1] == {"token": "token_id:9", "logprob": -1.5}
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
