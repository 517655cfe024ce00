"""The embedded engine's fast decoder on a GPU (skipped, with the reason, without CUDA: the CPU suite and CI have
none). Run on a GPU host with `python -m pytest tests/gpu/test_embedded_engine_cuda.py`.

What is checked: greedy decode through the CUDA graphs equals the uncached reference forward, one step and several
steps per call (sampling inside the graph), uncompiled and with the decode layer compiled (`inference.compile`); the
engine with chunks launched ahead (`overlap`) samples what it samples one step at a time.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled-graphs"])
def test_fast_decoder_self_check_on_cuda(compile: bool):
    from primerl.inference.engines.llama_check import self_check

    self_check("tiny", device="cuda", compile=compile)


def test_chunks_launched_ahead_equal_one_step_at_a_time_on_cuda():
    """The engine on CUDA, the decode layer and the sampler compiled, float32: chunks of 8 steps with the next chunk
    launched before the host reads the last (`overlap`, the CUDA default) give seeded requests the tokens of one
    step at a time (a row past the first attention span, rows finishing inside chunks) and their logprobs."""
    import asyncio

    from primerl.inference.engines.base import Finish, SamplingParams
    from primerl.inference.engines.hf import HFEngine

    prompts = [[1, 17, 45, 300, 12], [1, 99], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 512, 3]]
    params = [
        SamplingParams(max_tokens=140, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.7, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.3, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
    ]

    async def run(decode_steps: int, overlap: bool):
        engine = HFEngine("tiny", device="cuda", dtype="float32", max_batch_size=8, compile=True,
                          decode_steps=decode_steps, overlap=overlap)
        await engine.start()
        try:
            async def one(i: int):
                events = [e async for e in engine.generate(prompts[i], params[i], f"r{i}")]
                assert isinstance(events[-1], Finish)
                return [e.token_id for e in events[:-1]], [e.logprob for e in events[:-1]]

            results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            assert engine.compile, "the compile failed and the engine fell back to the uncompiled step"
            return results, engine.chunks_ahead
        finally:
            await engine.stop()

    one_step, _ = asyncio.run(run(1, False))
    ahead, chunks_ahead = asyncio.run(run(8, True))
    assert chunks_ahead > 0
    for (tokens, logprobs), (tokens_ahead, logprobs_ahead) in zip(one_step, ahead, strict=True):
        assert tokens_ahead == tokens
        torch.testing.assert_close(torch.tensor(logprobs_ahead), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)
    assert [len(tokens) for tokens, _ in ahead] == [140, 5, 30, 9]


def test_a_row_growing_past_the_first_cache_capacity_recaptures_the_graphs():
    """The cache starts at 256 positions and the warm-up captures the graphs at that capacity; a row that decodes
    past it grows the cache, which drops every captured graph, and the next capture must succeed (it failed in the
    caching allocator while the old graphs' pool was reused) and go on sampling what one step at a time samples."""
    import asyncio

    from primerl.inference.engines.base import Finish, SamplingParams
    from primerl.inference.engines.hf import HFEngine

    prompt = [1, 17, 45, 300, 12, 7, 8]
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=11, ignore_eos=True)

    async def run(cuda_graphs: bool) -> list[int]:
        engine = HFEngine("tiny", device="cuda", dtype="float32", max_batch_size=4, compile=True,
                          decode_steps=8, overlap=True, cuda_graphs=cuda_graphs)
        await engine.start()
        try:
            events = [e async for e in engine.generate(prompt, params, "long")]
            assert isinstance(events[-1], Finish) and events[-1].reason == "length", events[-1]
            assert engine.compile
            return [e.token_id for e in events[:-1]]
        finally:
            await engine.stop()

    graphs = asyncio.run(run(True))
    assert len(graphs) == 400
    assert graphs == asyncio.run(run(False))
