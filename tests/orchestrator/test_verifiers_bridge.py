"""The verifiers bridge against the real inference server on the tiny model: token ids, sampling masks, logprobs,
policy versions and turn structure of single-turn, multi-turn and tool-use rollouts. (The tiny model's replies are
noise, so rewards are only checked for range.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import verifiers.v1 as vf
from renderers import DefaultRendererConfig
from renderers.base import load_tokenizer

from primerl.orchestrator.client import install_model_client_transport
from primerl.orchestrator.verifiers_bridge import (
    RolloutSample,
    chat_client,
    load_env,
    policy_version,
    rollout_seed,
    run_group,
    samples_from_episode,
    train_client,
)
from primerl.orchestrator.versions import TOKEN_VERSIONS
from primerl.ports import free_port

pytestmark = pytest.mark.integration
MAX_TOKENS = 12
SAMPLING = vf.SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS)
# ChatML chat template without a model-specific renderer: Hermes-style tool-call parsing makes tools renderable.
RENDERER = DefaultRendererConfig(tool_parser="qwen3")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "inference.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "primerl.cli", "inference", "--model.name", "tiny", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def rollouts(server: str, tiny_model_dir: Path, env_id: str, n: int, chat: bool = False,
             seeds: list[int] | None = None) -> list[RolloutSample]:
    env = load_env(env_id)
    task = next(iter(env.taskset))
    client = chat_client(server) if chat else train_client(server, tiny_model_dir, RENDERER)

    async def go() -> list[RolloutSample]:
        async with env.serving(), httpx.AsyncClient(base_url=server) as http:
            return await run_group(
                env, task, n, model="tiny", client=client, sampling=SAMPLING,
                current_version=lambda: policy_version(http), seeds=seeds,
            )

    return asyncio.run(go())


def check_tokens(sample: RolloutSample) -> None:
    assert sample.error is None and sample.policy_versions == (0, 0)
    assert len(sample.input_ids) == len(sample.loss_mask) == len(sample.inference_logprobs) > sample.prompt_len > 0
    assert set(sample.loss_mask) == {0, 1} and sample.loss_mask[sample.prompt_len] == 1
    for masked, logprob in zip(sample.loss_mask, sample.inference_logprobs, strict=True):
        assert logprob < 0 if masked else logprob == 0.0
    assert 0.0 <= sample.reward <= 1.0


def test_single_turn_samples_carry_tokens_mask_and_logprobs(server: str, tiny_model_dir: Path) -> None:
    samples = rollouts(server, tiny_model_dir, "reverse-text", n=3)
    assert len(samples) == 3 and len({s.trace_id for s in samples}) == 3
    tokenizer = load_tokenizer(str(tiny_model_dir))
    phrase = next(iter(load_env("reverse-text").taskset)).data.text
    for sample in samples:
        check_tokens(sample)
        assert sample.num_turns == 1 and sample.env == "reverse-text"
        # one turn: the prompt, then exactly the sampled completion
        assert sample.loss_mask == [0] * sample.prompt_len + [1] * sample.completion_len
        assert 1 <= sample.completion_len <= MAX_TOKENS
        assert sample.is_truncated == (sample.completion_len == MAX_TOKENS)
        assert phrase in tokenizer.decode(sample.input_ids[: sample.prompt_len])
        assert set(sample.rewards) == {"reversal_similarity"} and sample.reward == sample.rewards["reversal_similarity"]


def test_seeded_rollouts_sample_the_same_tokens_whatever_order_they_reach_the_server(
    server: str, tiny_model_dir: Path
) -> None:
    seeds = [rollout_seed(seed=7, draw=3, rollout=i) for i in range(4)]
    assert len(set(seeds)) == 4 and rollout_seed(7, 3, 0) == seeds[0] != rollout_seed(8, 3, 0)
    first = [s.input_ids for s in rollouts(server, tiny_model_dir, "reverse-text", n=4, seeds=seeds)]
    again = [s.input_ids for s in rollouts(server, tiny_model_dir, "reverse-text", n=4, seeds=seeds)]
    reversed_order = [s.input_ids for s in rollouts(server, tiny_model_dir, "reverse-text", n=4, seeds=seeds[::-1])]
    assert first == again == reversed_order[::-1]
    assert len({tuple(ids) for ids in first}) > 1  # each rollout its own seed, not one shared


def test_multi_turn_rollout_plays_every_batch(server: str, tiny_model_dir: Path) -> None:
    env = load_env("alphabet-sort")
    task = next(iter(env.taskset))
    ctx = vf.ModelContext(model="tiny", client=train_client(server, tiny_model_dir, RENDERER), sampling=SAMPLING)

    async def go() -> vf.Episode:
        async with env.serving():
            return await env.run_episode(task, ctx)

    episode = asyncio.run(go())
    (trace,) = episode.traces
    batches = task.data.batches
    assert trace.num_turns == len(batches) and trace.stop_condition == "user_closed"
    user_turns = [node.message.content for node in trace.nodes if node.message.role == "user"]
    assert all(any(name in turn for turn in user_turns) for batch in batches for name in batch)
    samples = samples_from_episode(episode, (0, 0))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    for sample in samples:
        check_tokens(sample)
        assert sample.num_turns == len(batches)
    # every sampled turn is trained exactly once, and a sample's later turns include the user's new names
    completion_tokens = sum(call.usage.completion_tokens for call in trace.calls)
    assert sum(s.num_sampled_tokens for s in samples) == completion_tokens
    last = max(samples, key=lambda s: len(s.input_ids))
    assert all(name in tokenizer.decode(last.input_ids) for name in batches[0])


def test_samples_take_their_versions_from_the_tokens_not_the_bracket(server: str, tiny_model_dir: Path) -> None:
    """With primerl's model clients installed, each sampled turn's per-token versions come from the server's answers:
    a bracket that claims version 7 (the server serves 0) is only the fallback, and is not used here."""
    install_model_client_transport()
    env = load_env("alphabet-sort")
    task = next(iter(env.taskset))

    async def claims_seven() -> int:
        return 7

    async def go() -> list[RolloutSample]:
        async with env.serving():
            return await run_group(env, task, 2, model="tiny", client=train_client(server, tiny_model_dir, RENDERER),
                                   sampling=SAMPLING, current_version=claims_seven)

    samples = asyncio.run(go())
    assert samples and all(s.num_turns > 1 for s in samples)
    for sample in samples:
        assert sample.policy_versions == (0, 0)
        assert sample.version_segments == ((0, sample.num_sampled_tokens),)
    assert len(TOKEN_VERSIONS) == 0  # every recorded turn was used by a sample, then forgotten


def test_tool_environment_through_the_token_route(server: str, tiny_model_dir: Path) -> None:
    samples = rollouts(server, tiny_model_dir, "wiki-search", n=2)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    for sample in samples:
        check_tokens(sample)
        prompt = tokenizer.decode(sample.input_ids[: sample.prompt_len])
        assert '"name": "search_wiki"' in prompt and '"name": "read_article"' in prompt


def test_tool_environment_through_chat_completions(server: str, tiny_model_dir: Path) -> None:
    samples = rollouts(server, tiny_model_dir, "wiki-search", n=2, chat=True)
    for sample in samples:
        assert sample.error is None and sample.num_turns >= 1
        assert sample.input_ids == [] and sample.rewards == {"correct_answer": sample.reward}
        assert sample.metrics["tool_calls"] >= 0


def test_renderer_parses_tool_calls_from_sampled_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Tool calls on the token route are parsed by the renderer from the sampled ids; the Hermes parser needs the
    tool-call tags as single tokens, so this test adds them to a copy of the tiny tokenizer."""
    from renderers import create_renderer
    from tokenizers import AddedToken, Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.add_special_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    raw.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(str(tmp_path))
    renderer = create_renderer(tokenizer, RENDERER)
    from wiki_search import TOOLS

    tools = [tool.spec() for tool in TOOLS]
    prompt = renderer.render([{"role": "user", "content": "Who?"}], tools=tools, add_generation_prompt=True)
    completion = '<tool_call>\n{"name": "search_wiki", "arguments": {"query": "Halvik"}}\n</tool_call><|im_end|>'
    parsed = renderer.parse_response(
        tokenizer.encode(completion, add_special_tokens=False), prompt_ids=prompt.token_ids, tools=tools
    )
    (call,) = parsed.tool_calls
    assert call.name == "search_wiki" and call.arguments in ({"query": "Halvik"}, '{"query": "Halvik"}')
