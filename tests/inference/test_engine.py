"""The embedded engine on the tiny model: batching, sampling, stops, weight updates, pause/resume."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from primerl.inference.engines.base import Finish, SamplingParams, TokenEvent
from primerl.inference.engines.hf import HFEngine

PROMPTS = [[1, 17, 45, 300, 12], [1, 99], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 512, 3]]


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def with_engine(model_dir: Path, test: Callable[[HFEngine], Awaitable[None]], **options) -> None:
    async def main() -> None:
        engine = HFEngine(model_dir, max_batch_size=8, **options)
        await engine.start()
        try:
            await test(engine)
        finally:
            await engine.stop()

    asyncio.run(main())


async def complete(engine: HFEngine, prompt: list[int], params: SamplingParams, request_id: str):
    """Run one request to the end: (token events, finish)."""
    events = [event async for event in engine.generate(prompt, params, request_id)]
    assert all(isinstance(e, TokenEvent) for e in events[:-1]) and isinstance(events[-1], Finish)
    return events[:-1], events[-1]


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with the plain HF forward over the whole sequence at every step (no cache)."""
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(prompt) :]


@torch.inference_mode()
def reference_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) at each completion token, from one uncached forward."""
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("decoder", ["fast", "reference"])
def test_concurrent_greedy_equals_uncached_reference(tiny_model_dir, reference_model, decoder):
    async def test(engine: HFEngine) -> None:
        results = await asyncio.gather(*(complete(engine, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)))
        for prompt, (events, finish) in zip(PROMPTS, results, strict=True):
            assert [e.token_id for e in events] == reference_greedy(reference_model, prompt, GREEDY.max_tokens)
            assert (finish.reason, finish.prompt_tokens, finish.completion_tokens) == ("length", len(prompt), 24)

    with_engine(tiny_model_dir, test, decoder=decoder)


def test_a_server_that_keeps_freed_memory_packs_twice_at_load_and_serves_the_same_tokens(
    tiny_model_dir, reference_model, monkeypatch
):
    """With freed memory kept (as the CPU server does), the engine writes every weight once and packs the weights a
    second time at load, for the first weight update's sake: what it serves is unchanged."""
    from primerl.inference.engines import hf

    monkeypatch.setattr(hf, "keeps_freed_memory", lambda: True)
    prefaulted = []
    original = HFEngine._prefault_weight_intake
    monkeypatch.setattr(HFEngine, "_prefault_weight_intake", lambda self: (prefaulted.append(1), original(self)))

    async def test(engine: HFEngine) -> None:
        assert prefaulted == [1]
        params = dict(engine.model.named_parameters())
        assert all(torch.equal(params[n], p) for n, p in reference_model.named_parameters())
        results = await asyncio.gather(*(complete(engine, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)))
        for prompt, (events, _) in zip(PROMPTS, results, strict=True):
            assert [e.token_id for e in events] == reference_greedy(reference_model, prompt, GREEDY.max_tokens)

    with_engine(tiny_model_dir, test, device="cpu")


HEAP_CHILD = """
import asyncio, sys
from primerl.cpu import heap_bytes, keep_freed_memory
from primerl.inference.engines.hf import HFEngine

def anonymous_mb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:")) / 1024

async def main(model):
    assert keep_freed_memory(), "glibc's mallopt refused"
    engine = HFEngine(model, max_batch_size=4, device="cpu")
    await engine.start()
    for step in (1, 2):  # the second time the free space is no larger than at the first trim
        blocks = [bytes([step]) * 2**20 for _ in range(400)]  # 400 MB written on the heap (no mmap: kept when freed)
        del blocks
        before, free = anonymous_mb(), heap_bytes()[1]
        await engine.update_weights(model, step=step)
        print(before, anonymous_mb(), free / 2**20)
    await engine.stop()

asyncio.run(main(sys.argv[1]))
"""


def test_a_weight_version_hands_back_the_free_heap_its_pages_grew_into(tiny_model_dir):
    """The CPU server keeps freed memory for reuse (`keep_freed_memory`), so pages written once stay the process's
    even when free: after every weight version the server hands the free pages back, also where the free space has
    not grown since the last trim but allocations have faulted the pages it handed back in again (the demo's server
    crept ~0.25 MB a step that way; benchmarks/NOTES.md, "The long-run soak"). Run in a child, whose allocator
    settings are its own."""
    done = subprocess.run([sys.executable, "-c", HEAP_CHILD, str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    for line in done.stdout.splitlines()[-2:]:
        before, after, free = map(float, line.split())
        assert free > 350, f"the freed blocks were not kept in the heap ({free:.0f} MB free)"
        assert after < before - 300, f"anonymous memory {before:.0f} -> {after:.0f} MB: the free heap was kept"


@pytest.mark.parametrize("overlap", [False, True])
def test_request_joins_running_batch_mid_decode(tiny_model_dir, reference_model, overlap):
    """B arrives while A decodes (A is held by pause a few tokens in); B is admitted at the next step, long before
    A ends, and both still produce exactly their solo greedy output (also with the next chunk launched before the
    host reads the last)."""
    long_a = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    arrivals: list[tuple[str, int]] = []

    async def consume(stream, name: str, tokens: list[int]) -> list[int]:
        async for event in stream:
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
                arrivals.append((name, len(tokens)))
        return tokens

    async def test(engine: HFEngine) -> None:
        stream_a = engine.generate(PROMPTS[0], long_a, "a")
        first = await anext(stream_a)
        await engine.pause()
        task_a = asyncio.create_task(consume(stream_a, "a", [first.token_id]))
        task_b = asyncio.create_task(consume(engine.generate(PROMPTS[1], GREEDY, "b"), "b", []))
        await asyncio.sleep(0)
        await engine.resume()
        tokens_a, tokens_b = await asyncio.gather(task_a, task_b)
        assert tokens_a == reference_greedy(reference_model, PROMPTS[0], 200)
        assert tokens_b == reference_greedy(reference_model, PROMPTS[1], 24)
        assert arrivals.index(("b", 24)) < arrivals.index(("a", 199))

    with_engine(tiny_model_dir, test, overlap=overlap)


def test_seeded_sampling_is_independent_of_the_batch(tiny_model_dir):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)

    async def test(engine: HFEngine) -> None:
        alone, _ = await complete(engine, PROMPTS[0], params, "alone")
        crowd_params = [
            SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, ignore_eos=True) for n in (3, 30, 7)
        ] + [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
        crowd = [complete(engine, p, cp, f"c{i}") for i, (p, cp) in enumerate(zip(PROMPTS, crowd_params))]
        results = await asyncio.gather(*crowd[:2], complete(engine, PROMPTS[0], params, "crowded"), *crowd[2:])
        other_seed, _ = await complete(engine, PROMPTS[0], SamplingParams(**{**params.__dict__, "seed": 99}), "o")
        crowded = results[2][0]
        assert [e.token_id for e in crowded] == [e.token_id for e in alone]
        assert [e.token_id for e in other_seed] != [e.token_id for e in alone]

    with_engine(tiny_model_dir, test)


def test_logprobs_are_those_of_the_sampling_distribution(tiny_model_dir, reference_model):
    async def test(engine: HFEngine) -> None:
        temperature = 0.7
        params = SamplingParams(max_tokens=16, temperature=temperature, seed=5, ignore_eos=True)
        events, _ = await complete(engine, PROMPTS[2], params, "t")
        tokens = [e.token_id for e in events]
        expected = reference_logprobs(reference_model, PROMPTS[2], tokens, temperature)
        torch.testing.assert_close(torch.tensor([e.logprob for e in events]), expected, atol=1e-4, rtol=1e-4)

        # top-k: every token is among the 5 most likely, with its probability renormalized over those 5
        events, _ = await complete(engine, PROMPTS[2], SamplingParams(**{**params.__dict__, "top_k": 5}), "k")
        tokens = [e.token_id for e in events]
        with torch.inference_mode():
            logits = reference_model(torch.tensor([PROMPTS[2] + tokens])).logits[0, len(PROMPTS[2]) - 1 : -1]
        top = torch.log_softmax(logits / temperature, dim=-1).topk(5, dim=-1)
        for position, event in enumerate(events):
            assert event.token_id in top.indices[position].tolist()
            renormalized = top.values[position] - top.values[position].logsumexp(0)
            expected_lp = renormalized[top.indices[position].tolist().index(event.token_id)]
            assert event.logprob == pytest.approx(float(expected_lp), abs=1e-4)

        # greedy: the logprob under the untempered distribution
        events, _ = await complete(engine, PROMPTS[2], GREEDY, "g")
        expected = reference_logprobs(reference_model, PROMPTS[2], [e.token_id for e in events], 1.0)
        torch.testing.assert_close(torch.tensor([e.logprob for e in events]), expected, atol=1e-4, rtol=1e-4)

    with_engine(tiny_model_dir, test)


def test_finish_reasons(tiny_model_dir, reference_model):
    prompt = PROMPTS[0]
    greedy = reference_greedy(reference_model, prompt, 24)

    async def test(engine: HFEngine) -> None:
        # a stop token id ends at its first occurrence and is kept
        stop_id = greedy[5]
        events, finish = await complete(
            engine, prompt, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id]), "id"
        )
        assert [e.token_id for e in events] == greedy[: greedy.index(stop_id) + 1]
        assert (finish.reason, finish.stop) == ("stop", stop_id)

        # a stop string ends at the token that completes it
        text = engine.tokenizer.decode(greedy)
        stop = text[len(engine.tokenizer.decode(greedy[:6])) :][:3]
        assert stop, "the greedy completion is too short to pick a stop string"
        events, finish = await complete(engine, prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop]), "s")
        tokens = [e.token_id for e in events]
        assert (finish.reason, finish.stop) == ("stop", stop)
        assert stop in engine.tokenizer.decode(tokens) and stop not in engine.tokenizer.decode(tokens[:-1])

        events, finish = await complete(engine, prompt, SamplingParams(max_tokens=3, temperature=0.0), "len")
        assert (finish.reason, finish.completion_tokens, len(events)) == ("length", 3, 3)

    with_engine(tiny_model_dir, test)


def test_max_model_len_bounds_prompt_and_completion(tiny_model_dir):
    async def test(engine: HFEngine) -> None:
        assert engine.max_model_len == 16
        events, finish = await complete(engine, list(range(1, 11)), GREEDY, "fits")
        assert (finish.reason, finish.prompt_tokens + finish.completion_tokens, len(events)) == ("length", 16, 6)
        with pytest.raises(ValueError, match="max_model_len"):
            engine.generate(list(range(1, 17)), GREEDY, "too-long")
        with pytest.raises(ValueError, match="empty"):
            engine.generate([], GREEDY, "empty")

    with_engine(tiny_model_dir, test, max_model_len=16)


@pytest.mark.parametrize("overlap", [False, True])
def test_update_weights_applies_between_steps(tiny_model_dir, tmp_path, overlap, perturbed_tiny_model):
    new_weights = perturbed_tiny_model(tmp_path / "step_3", scale=0.05)
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file({"model.norm.weight": torch.ones(3)}, broken / "model.safetensors")
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)

    async def test(engine: HFEngine) -> None:
        before, finish_before = await complete(engine, PROMPTS[0], params, "before")
        assert finish_before.policy_versions == (0, 0)
        with pytest.raises(ValueError, match="model.norm.weight"):
            await engine.update_weights(broken, step=9)
        assert engine.policy_version == 0

        long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        in_flight = engine.generate(PROMPTS[1], long, "in-flight")
        events = [await anext(in_flight)]
        await engine.pause()
        await engine.update_weights(new_weights, step=3)
        await engine.resume()
        events += [event async for event in in_flight]
        versions = [e.policy_version for e in events[:-1]]
        switch = versions.index(3)  # tokens sampled before the update, then only after it
        assert switch >= 1 and set(versions[:switch]) == {0} and set(versions[switch:]) == {3}
        assert events[-1].policy_versions == (0, 3) and events[-1].completion_tokens == 300

        after, finish_after = await complete(engine, PROMPTS[0], params, "after")
        assert engine.policy_version == 3 and finish_after.policy_versions == (3, 3)
        assert [e.token_id for e in after] != [e.token_id for e in before]

    with_engine(tiny_model_dir, test, overlap=overlap)


def test_pause_holds_requests_until_resume(tiny_model_dir):
    async def test(engine: HFEngine) -> None:
        await engine.pause()
        stream = engine.generate(PROMPTS[0], GREEDY, "held")
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.3)
        assert not pending.done()
        await engine.resume()
        first = await pending
        assert isinstance(first, TokenEvent)
        rest = [event async for event in stream]
        assert rest[-1].completion_tokens == GREEDY.max_tokens

    with_engine(tiny_model_dir, test)


def test_abandoned_and_aborted_requests_free_their_rows(tiny_model_dir, reference_model):
    async def test(engine: HFEngine) -> None:
        for i in range(3 * engine.max_batch_size):  # more abandoned streams than rows
            stream = engine.generate(PROMPTS[i % 4], GREEDY, f"abandoned-{i}")
            await anext(stream)
            await stream.aclose()
        stream = engine.generate(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), "x")
        await anext(stream)
        engine.abort("x")
        last = [event async for event in stream][-1]
        assert last.reason == "abort" and last.completion_tokens < 200
        events, _ = await complete(engine, PROMPTS[3], GREEDY, "after")
        assert [e.token_id for e in events] == reference_greedy(reference_model, PROMPTS[3], 24)

    with_engine(tiny_model_dir, test)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A random-init Qwen3 (q/k norms, head_dim unlike hidden / heads) of a few hundred thousand parameters."""
    from transformers import AutoTokenizer, Qwen3Config

    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-qwen3")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize("model_dir", ["tiny_model_dir", "tiny_qwen3_dir"])
def test_fast_decoder_self_check(model_dir, request):
    """The module's own check: greedy rows of different lengths, one retired mid-way, equal the uncached forward."""
    from primerl.inference.engines.llama_check import self_check

    self_check(str(request.getfixturevalue(model_dir)), device="cpu")


def test_chunked_decode_equals_one_step_at_a_time(tiny_model_dir):
    """Several decode steps per host round trip (sampling on the device) produce exactly the tokens of one step at a
    time for seeded requests, finish where they would have (a stop token mid-chunk drops the tokens after it), and
    the same logprobs; so does `overlap`, where the next chunk is launched before the host reads the last one (a
    row that finished in the chunk read drops its tokens of the chunk launched after it)."""
    free = SamplingParams(max_tokens=30, temperature=1.3, seed=5, ignore_eos=True)

    async def unstopped(engine: HFEngine) -> None:
        events, _ = await complete(engine, PROMPTS[2], free, "free")
        free_tokens.extend(e.token_id for e in events)

    free_tokens: list[int] = []
    with_engine(tiny_model_dir, unstopped, decode_steps=1)
    # a stop token request 2 meets first inside a chunk of 8 (not at a chunk's last step), at least 2 tokens in
    stop_at = next(i for i, t in enumerate(free_tokens) if i >= 2 and i % 8 != 7 and free_tokens.index(t) == i)
    stop_token = free_tokens[stop_at]
    requests = [
        # 140 tokens: past the decoder's first attention span (128 positions) inside a chunk launched ahead
        (PROMPTS[0], SamplingParams(max_tokens=140, temperature=1.0, seed=3, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=5, temperature=0.7, seed=4, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=30, temperature=1.3, seed=5, stop_token_ids=[stop_token], ignore_eos=True)),
        (PROMPTS[3], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),
    ]
    outputs = {}
    for steps, overlap in ((1, False), (8, False), (8, True), (3, True)):

        async def test(engine: HFEngine, key=(steps, overlap)) -> None:
            results = await asyncio.gather(
                *(complete(engine, prompt, params, f"r{i}") for i, (prompt, params) in enumerate(requests))
            )
            outputs[key] = [
                ([e.token_id for e in events], [e.logprob for e in events], finish.reason) for events, finish in results
            ]
            assert (engine.chunks_ahead > 0) == key[1]

        with_engine(tiny_model_dir, test, decode_steps=steps, overlap=overlap)
    for key in ((8, False), (8, True), (3, True)):
        for one, chunked in zip(outputs[(1, False)], outputs[key], strict=True):
            assert chunked[0] == one[0] and chunked[2] == one[2], key
            torch.testing.assert_close(torch.tensor(chunked[1]), torch.tensor(one[1]), atol=1e-5, rtol=1e-5)
    assert [len(tokens) for tokens, _, _ in outputs[(8, True)]][:2] == [140, 5] and outputs[(8, True)][3][2] == "length"
    assert outputs[(1, False)][2][0] == free_tokens[: stop_at + 1] and outputs[(1, False)][2][2] == "stop"


def test_fast_decoder_self_check_compiled(tiny_qwen3_dir, inductor_cpu):
    """The same check through the compiled decode layer (`inference.compile`; here inductor's CPU code): one compile
    serves every layer and shape (q/k norms included), and its greedy tokens equal the uncached forward's. Skipped,
    with the reason, where torch cannot build CPU code (e.g. no setuptools in the environment)."""
    from primerl.inference.engines.llama_check import self_check

    self_check(str(tiny_qwen3_dir), device="cpu", compile=True)


def test_failed_compile_falls_back_to_the_uncompiled_step(tiny_model_dir, reference_model, monkeypatch, caplog):
    """Where the decode step cannot be compiled (no triton or C compiler: here the warm-up is made to fail), the engine
    says so once and serves with the uncompiled step, whose greedy tokens equal the reference's."""
    from primerl.inference.engines.llama import LlamaDecoder

    def no_compiler(self):
        raise RuntimeError("no working compiler\nsecond line")

    monkeypatch.setattr(LlamaDecoder, "warm_up", no_compiler)

    async def test(engine: HFEngine) -> None:
        assert engine.compile is False and engine.decoder.compiled is False
        tokens, _ = await complete(engine, PROMPTS[0], GREEDY, "after-fallback")
        assert [t.token_id for t in tokens] == reference_greedy(reference_model, PROMPTS[0], GREEDY.max_tokens)

    with caplog.at_level("WARNING", logger="primerl"):
        with_engine(tiny_model_dir, test, compile=True)
    assert any("compiling the decode step failed (RuntimeError: no working compiler)" in r.getMessage()
               for r in caplog.records)
