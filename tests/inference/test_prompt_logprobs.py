"""Scoring token sequences on the token route: `sampling_params.prompt_logprobs` (vLLM's field) returns the log-prob
of every token given the ones before it, and `max_tokens = 0` scores without sampling. The teacher of on-policy
distillation is asked exactly this. Checked against the model run directly with transformers, and against the
server's own sampling log-probs of the same tokens."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from server_process import RunningServer

MODEL = "tiny"
TOKENS = [5, 17, 260, 3, 99, 41, 7, 512, 300]


def generate(server: RunningServer, token_ids: list[int], **sampling) -> httpx.Response:
    body = {"model": MODEL, "token_ids": token_ids, "sampling_params": sampling}
    return httpx.post(f"{server.base_url}/inference/v1/generate", json=body, timeout=60)


def scores(body: dict, token_ids: list[int]) -> list[float]:
    entries = body["prompt_logprobs"]
    assert len(entries) == len(token_ids) and entries[0] is None
    assert all(list(entry) == [str(t)] for entry, t in zip(entries[1:], token_ids[1:]))
    return [entry[str(t)]["logprob"] for entry, t in zip(entries[1:], token_ids[1:])]


def test_max_tokens_zero_scores_the_tokens_as_the_model_does(server: RunningServer, tiny_model_dir):
    response = generate(server, TOKENS, max_tokens=0, prompt_logprobs=0)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["token_ids"] for c in body["choices"]] == [[]]
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0]
    reference = torch.log_softmax(logits, -1)[torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:])].tolist()
    assert scores(body, TOKENS) == pytest.approx(reference, abs=1e-5)


def test_the_scores_of_sampled_tokens_are_their_sampling_log_probs(server: RunningServer):
    # what distillation relies on: entry i of the scores belongs to token i, as a batch's inference log-probs do
    prompt = TOKENS[:4]
    sampled = generate(server, prompt, max_tokens=12, temperature=1.0, logprobs=1, seed=3, ignore_eos=True).json()
    choice = sampled["choices"][0]
    completion = choice["token_ids"]
    sampling = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    body = generate(server, prompt + completion, max_tokens=0, prompt_logprobs=1).json()
    assert scores(body, prompt + completion)[len(prompt) - 1:] == pytest.approx(sampling, abs=1e-4)


def test_prompt_logprobs_come_with_a_completion_too(server: RunningServer):
    body = generate(server, TOKENS, max_tokens=3, prompt_logprobs=0, seed=1, n=2).json()
    assert len(body["choices"]) == 2 and all(1 <= len(c["token_ids"]) <= 3 for c in body["choices"])
    assert all(math.isfinite(x) and x <= 0 for x in scores(body, TOKENS))
    assert generate(server, TOKENS, max_tokens=3).json().get("prompt_logprobs") is None


@pytest.mark.parametrize(("sampling", "message"), [
    ({"max_tokens": 0}, "needs prompt_logprobs"),
    ({"max_tokens": -1, "prompt_logprobs": 0}, "max_tokens"),
    ({"max_tokens": 0, "prompt_logprobs": -2}, "prompt_logprobs"),
])
def test_bad_scoring_requests_are_400(server: RunningServer, sampling, message):
    response = generate(server, TOKENS, **sampling)
    assert response.status_code == 400 and message in response.text, response.text


def test_a_sequence_longer_than_the_context_is_400(server: RunningServer):
    limit = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["max_model_len"]
    response = generate(server, [5] * (limit + 1), max_tokens=0, prompt_logprobs=0)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
