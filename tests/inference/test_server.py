"""The inference server, started as a real process on the tiny model and driven by real clients: the official
`openai` client, raw HTTP for the token route, and the renderer client verifiers uses for training."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError, OpenAI
from server_process import RunningServer, start_server

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


def chat(client: OpenAI, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", HELLO), **kwargs)


def generate(server: RunningServer, token_ids: list[int], **sampling) -> httpx.Response:
    body = {"model": MODEL, "token_ids": token_ids, "sampling_params": sampling}
    return httpx.post(f"{server.base_url}/inference/v1/generate", json=body, timeout=60)


# ---------------------------------------------------------------------------------------------------------------------
# discovery


def test_health_and_models(server: RunningServer, client: OpenAI):
    health = httpx.get(f"{server.base_url}/health").json()
    assert health == {"status": "ok", "model": MODEL, "policy_version": 0, "paused": False}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] > 0


# ---------------------------------------------------------------------------------------------------------------------
# /v1/chat/completions through the official client


def test_chat_completion(client: OpenAI):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=12, seed=1)
    completion = raw.parse()
    assert raw.headers["x-policy-version"] == "0"
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert choice.model_extra["policy_versions"] == [0]
    assert 1 <= completion.usage.completion_tokens <= 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_streaming_matches_non_streaming(client: OpenAI):
    expected = chat(client, max_tokens=16, seed=7)
    stream = chat(client, max_tokens=16, seed=7, stream=True, stream_options={"include_usage": True})
    text, finish, usage, versions = "", None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            versions = (choice.model_extra or {}).get("policy_versions") or versions
    assert text == expected.choices[0].message.content
    assert finish == expected.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == expected.usage.completion_tokens
    assert versions == [0]


def test_seeds_make_samples_reproducible(client: OpenAI):
    first = chat(client, max_tokens=16, seed=11).choices[0].message.content
    again = chat(client, max_tokens=16, seed=11).choices[0].message.content
    other = chat(client, max_tokens=16, seed=12).choices[0].message.content
    assert first == again
    assert first != other


def test_n_samples_use_consecutive_seeds(client: OpenAI):
    completion = chat(client, max_tokens=10, seed=20, n=3)
    singles = [chat(client, max_tokens=10, seed=20 + i) for i in range(3)]
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert [c.message.content for c in completion.choices] == [s.choices[0].message.content for s in singles]
    assert completion.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert completion.usage.prompt_tokens == singles[0].usage.prompt_tokens


def test_n_samples_stream(client: OpenAI):
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in chat(client, max_tokens=8, seed=30, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert texts[0] == chat(client, max_tokens=8, seed=30).choices[0].message.content
    assert texts[1] == chat(client, max_tokens=8, seed=31).choices[0].message.content


def test_stop_string_cuts_the_text(client: OpenAI):
    full = chat(client, max_tokens=40, seed=5, temperature=1.0).choices[0].message.content
    assert len(full) > 12, full
    stop = full[8:11]
    cut = full[: full.index(stop)]
    stopped = chat(client, max_tokens=40, seed=5, temperature=1.0, stop=[stop])
    assert stopped.choices[0].message.content == cut
    assert stopped.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in chat(client, max_tokens=40, seed=5, temperature=1.0, stop=stop, stream=True)
        if c.choices
    )
    assert streamed == cut


def test_max_completion_tokens_and_greedy(client: OpenAI):
    completion = chat(client, max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 5
    assert completion.choices[0].finish_reason == "length"
    greedy_again = chat(client, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert greedy_again.choices[0].message.content == completion.choices[0].message.content


def test_logprobs_match_the_token_route(server: RunningServer, client: OpenAI, tiny_model_dir: Path):
    from transformers import AutoTokenizer

    completion = chat(client, max_tokens=12, seed=3, logprobs=True, top_logprobs=1)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [(entry.token, entry.logprob)]
    # The same prompt ids and seed through the token route give the same tokens and logprobs.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert len(prompt_ids) == completion.usage.prompt_tokens
    tokens = generate(server, prompt_ids, max_tokens=12, seed=3, logprobs=1).json()["choices"][0]
    assert [e["logprob"] for e in tokens["logprobs"]["content"]] == pytest.approx([e.logprob for e in content])
    assert [tokenizer.decode([t]) for t in tokens["token_ids"]] == [e.token for e in content]


def test_tools_reach_the_chat_template(client: OpenAI):
    tool = {
        "type": "function",
        "function": {"name": "lookup", "description": "Look a word up.", "parameters": {"type": "object"}},
    }
    plain = chat(client, max_tokens=1)
    with_tools = chat(client, max_tokens=1, tools=[tool])
    without = chat(client, max_tokens=1, tools=[tool], tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    assert without.usage.prompt_tokens == plain.usage.prompt_tokens
    # a conversation that already holds a tool call and its result renders too
    history = [
        *HELLO,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"w": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "found"},
    ]
    assert chat(client, messages=history, max_tokens=1, tools=[tool]).usage.prompt_tokens > (
        with_tools.usage.prompt_tokens
    )


# ---------------------------------------------------------------------------------------------------------------------
# /inference/v1/generate


def test_token_route_shape(server: RunningServer):
    prompt = [1, 330, 201, 74, 75]
    response = generate(server, prompt, max_tokens=6, seed=9, logprobs=1, skip_special_tokens=False, n=2)
    assert response.status_code == 200, response.text
    assert response.headers["x-policy-version"] == "0"
    body = response.json()
    assert body["request_id"] and body["prompt_token_ids"] == prompt
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert 1 <= len(choice["token_ids"]) <= 6
        assert choice["finish_reason"] in ("stop", "length")
        assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert all(e["logprob"] <= 0 for e in choice["logprobs"]["content"])
        assert choice["policy_versions"] == [0]
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])
    assert generate(server, prompt, max_tokens=6, seed=9).json()["choices"][0]["logprobs"] is None


def test_token_route_stop_token_ids(server: RunningServer):
    prompt = [1, 330, 201, 74, 75]
    free = generate(server, prompt, max_tokens=10, seed=4, ignore_eos=True).json()["choices"][0]["token_ids"]
    assert len(free) == 10
    stop_at = max(i for i in range(6) if free[i] not in free[:i])  # a token whose first occurrence is at stop_at
    stopped = generate(server, prompt, max_tokens=10, seed=4, ignore_eos=True, stop_token_ids=[free[stop_at]])
    choice = stopped.json()["choices"][0]
    assert choice["token_ids"] == free[: stop_at + 1]
    assert choice["finish_reason"] == "stop"


def test_renderer_client_generate(server: RunningServer, tiny_model_dir: Path):
    """verifiers' training client calls `renderers.client.generate`; drive it against the server."""
    from renderers import create_renderer
    from renderers.base import load_tokenizer
    from renderers.client import OverlongPromptError
    from renderers.client import generate as renderer_generate

    renderer = create_renderer(load_tokenizer(str(tiny_model_dir)))

    async def run() -> tuple[dict, Exception | None]:
        client = AsyncOpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
        result = await renderer_generate(
            client=client,
            renderer=renderer,
            messages=HELLO,
            model=MODEL,
            sampling_params={"max_tokens": 8, "temperature": 1.0, "seed": 2},
        )
        overlong = None
        try:  # the renderer's pre-flight check reads max_model_len from /v1/models
            await renderer_generate(
                client=client, renderer=renderer, messages=[{"role": "user", "content": "word " * 5000}], model=MODEL
            )
        except OverlongPromptError as e:
            overlong = e
        await client.close()
        return result, overlong

    result, overlong = asyncio.run(run())
    assert result["prompt_ids"] == renderer.render(HELLO, add_generation_prompt=True).token_ids
    assert 1 <= len(result["completion_ids"]) <= 8
    assert len(result["completion_logprobs"]) == len(result["completion_ids"])
    assert result["finish_reason"] in ("stop", "length")
    assert result["usage"]["prompt_tokens"] == len(result["prompt_ids"])
    assert overlong is not None


# ---------------------------------------------------------------------------------------------------------------------
# bad input: 4xx with an OpenAI-style body, and the server keeps serving

GOOD_CHAT = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
BAD_REQUESTS = {
    "unknown model": ("/v1/chat/completions", {**GOOD_CHAT, "model": "gpt-9"}, 404, "model"),
    "negative max_tokens": ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": -1}, 400, "max_tokens"),
    "zero max_completion_tokens": (
        "/v1/chat/completions",
        {**GOOD_CHAT, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    "malformed JSON": ("/v1/chat/completions", '{"model": "tiny", "messages": [', 400, None),
    "body not an object": ("/v1/chat/completions", "[1, 2]", 400, None),
    "wrong type": ("/v1/chat/completions", {**GOOD_CHAT, "temperature": "hot"}, 400, "temperature"),
    "no messages": ("/v1/chat/completions", {**GOOD_CHAT, "messages": []}, 400, "messages"),
    "bad role": (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    "n too large": ("/v1/chat/completions", {**GOOD_CHAT, "n": 100000}, 400, "n"),
    "n zero": ("/v1/chat/completions", {**GOOD_CHAT, "n": 0}, 400, "n"),
    "empty stop": ("/v1/chat/completions", {**GOOD_CHAT, "stop": [""]}, 400, "stop"),
    "top_p out of range": ("/v1/chat/completions", {**GOOD_CHAT, "top_p": 1.5}, 400, "top_p"),
    "forced tool choice": ("/v1/chat/completions", {**GOOD_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    "prompt longer than the context": (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": [{"role": "user", "content": "word " * 5000}]},
        400,
        "messages",
    ),
    "token route: prompt longer than the context": (
        "/inference/v1/generate",
        {"model": MODEL, "token_ids": [5] * 5000},
        400,
        "token_ids",
    ),
    "token route: empty prompt": ("/inference/v1/generate", {"model": MODEL, "token_ids": []}, 400, "token_ids"),
    "token route: id outside the vocabulary": (
        "/inference/v1/generate",
        {"model": MODEL, "token_ids": [1, 10**9]},
        400,
        "token_ids",
    ),
    "token route: unknown model": ("/inference/v1/generate", {"model": "x", "token_ids": [1]}, 404, "model"),
    "token route: wrong type": (
        "/inference/v1/generate",
        {"model": MODEL, "token_ids": [1], "sampling_params": {"max_tokens": "many"}},
        400,
        "sampling_params.max_tokens",
    ),
    "unknown route": ("/v1/completions/nowhere", {}, 404, None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_a_4xx_and_the_server_keeps_serving(server: RunningServer, case: str):
    path, body, status, param = BAD_REQUESTS[case]
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        f"{server.base_url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    after = httpx.post(f"{server.base_url}/v1/chat/completions", json=GOOD_CHAT, timeout=60)
    assert after.status_code == 200, after.text


def test_openai_client_sees_typed_errors(client: OpenAI):
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=HELLO)
    with pytest.raises(BadRequestError) as error:
        chat(client, messages=[{"role": "user", "content": "word " * 5000}])
    assert error.value.code == "context_length_exceeded"


def test_client_leaving_a_stream_early_aborts_it(server: RunningServer, client: OpenAI):
    stream = chat(client, max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------------------------------------------------
# admin routes


@pytest.mark.parametrize("route", ["/admin/update_weights", "/admin/pause", "/admin/resume"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}])
def test_admin_routes_need_the_token(server: RunningServer, route: str, headers: dict):
    response = httpx.post(f"{server.base_url}{route}", json={"path": "/x", "step": 1}, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_pause_holds_requests_until_resume(server: RunningServer):
    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            paused = await http.post("/admin/pause", headers=server.admin_headers())
            assert paused.json() == {"policy_version": 0, "paused": True}
            assert (await http.get("/health")).json()["paused"] is True
            request = asyncio.create_task(http.post("/v1/chat/completions", json=GOOD_CHAT))
            done, _ = await asyncio.wait({request}, timeout=1.0)
            assert not done, "a request completed while the engine was paused"
            resumed = await http.post("/admin/resume", headers=server.admin_headers())
            assert resumed.json()["paused"] is False
            assert (await request).status_code == 200

    asyncio.run(run())


def test_update_weights_rejects_a_missing_path(server: RunningServer):
    response = httpx.post(
        f"{server.base_url}/admin/update_weights",
        json={"path": "/no/such/weights", "step": 3},
        headers=server.admin_headers(),
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "path"
    assert httpx.get(f"{server.base_url}/health").json()["policy_version"] == 0


# ---------------------------------------------------------------------------------------------------------------------
# weight updates (own server: they change its weights)


def _wrong_shape_checkpoint(model_dir: Path, out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    name = next(iter(tensors))
    tensors[name] = tensors[name][:1].clone()
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors")
    return out


def test_weight_update_changes_the_answers(tiny_model_dir: Path, tmp_path: Path, perturbed_tiny_model):
    step_1 = perturbed_tiny_model(tmp_path / "weights" / "step_1")
    broken = _wrong_shape_checkpoint(tiny_model_dir, tmp_path / "weights" / "broken")
    with start_server(tiny_model_dir, tmp_path / "server", admin_token="secret-token") as server:
        assert server.admin_token == "secret-token"  # PRIMERL_ADMIN_TOKEN wins; the token file holds it
        client = OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
        before = chat(client, max_tokens=16, seed=42)
        assert before.choices[0].model_extra["policy_versions"] == [0]

        update = httpx.post(
            f"{server.base_url}/admin/update_weights",
            json={"path": str(step_1), "step": 1},
            headers=server.admin_headers(),
            timeout=60,
        )
        assert update.status_code == 200, update.text
        assert update.json() == {"policy_version": 1, "paused": False}

        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=16, seed=42)
        after = raw.parse()
        assert after.choices[0].message.content != before.choices[0].message.content
        assert after.choices[0].model_extra["policy_versions"] == [1]
        assert raw.headers["x-policy-version"] == "1"
        assert httpx.get(f"{server.base_url}/health").json()["policy_version"] == 1

        rejected = httpx.post(
            f"{server.base_url}/admin/update_weights",
            json={"path": str(broken), "step": 2},
            headers=server.admin_headers(),
            timeout=60,
        )
        assert rejected.status_code == 400
        assert "shape" in rejected.json()["error"]["message"]
        again = chat(client, max_tokens=16, seed=42)  # the old (step 1) weights still serve
        assert again.choices[0].message.content == after.choices[0].message.content
        assert again.choices[0].model_extra["policy_versions"] == [1]


# ---------------------------------------------------------------------------------------------------------------------
# process entry point


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is not None, reason="vllm is installed here; it would start"
)
def test_vllm_engine_without_vllm_is_one_clear_error(tiny_model_dir: Path):
    result = subprocess.run(
        [sys.executable, "-m", "primerl.cli", "inference", "--engine", "vllm", "--model.name", str(tiny_model_dir)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "vllm" in lines[0], result.stderr


def test_bad_config_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "primerl.cli", "inference", "--port", "not-a-port"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "port" in result.stderr


@pytest.mark.slow
def test_smollm2_answers_a_chat_request(smollm2_dir: Path, tmp_path: Path):
    with start_server(smollm2_dir, tmp_path, served_name="smollm2") as server:
        client = OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
        completion = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            max_tokens=16,
            temperature=0,
        )
        assert "paris" in completion.choices[0].message.content.lower()
        assert completion.choices[0].finish_reason == "stop"


def test_token_route_takes_ids_the_model_has_beyond_its_tokenizer(tiny_model_dir: Path, tmp_path: Path):
    """A padded embedding (more rows than the tokenizer has tokens, as Qwen3's) can sample an id past the tokenizer;
    the next turn's prompt carries it back, and the token route must take it. Ids past the embedding stay a 400."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    padded = len(tokenizer) + 64
    model.resize_token_embeddings(padded)
    out = tmp_path / "padded"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with start_server(out, tmp_path / "server") as server:
        inside = generate(server, [1, len(tokenizer) + 10], max_tokens=2)
        assert inside.status_code == 200, inside.text
        beyond = generate(server, [1, padded], max_tokens=2)
        assert beyond.status_code == 400 and f"0..{padded - 1}" in beyond.text
