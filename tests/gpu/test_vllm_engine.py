"""The vLLM engine behind the real `primerl inference` server, on a GPU (skipped, with the reason, without vllm or
CUDA: the CPU suite and CI have neither). Run on the GPU machine with `bash benchmarks/gpu_rl_x1.sh vllm-tests OUT`;
written for every vLLM the adapter supports (vllm_compat: 0.19, the CUDA 12 image's; 0.26; 0.32, the lock's).

Model: SmolLM2-135M's architecture with random weights (W0) and a second set (W1) from another seed, bfloat16; a
server on W1 started fresh answers what the module's server must answer after each update.
What is checked: chat, streaming chat, the token route's log-probs against transformers' for the same tokens, a
weight update landing while a greedy request decodes (its tokens before the update are W0's, the rest exactly W1's
greedy continuation of them: none dropped, none repeated, no KV block of W0 reused), greedy sampling after an update
equal to the fresh W1 server's (through a snapshot directory and through the trainer's shared CUDA buffer), and
sleep mode: the GPU memory a pause frees, a weight update while asleep with a request waiting, then sampling equal
to the fresh load (vLLM 0.26 and newer; before 0.26 the server refuses `vllm.sleep_level = 1` in one line).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (GPU-only extra)", allow_module_level=True)
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from engine import random_init_dir  # benchmarks/engine.py
from server_process import RunningServer, start_server

from primerl.inference.engines import vllm_compat

SERVER_ARGS = ("--engine", "vllm", "--vllm.gpu_memory_utilization=0.25", "--vllm.enforce_eager=true",
               "--max-model-len", "4096", "--weight_transfer", "shared")
PROMPT = list(range(100, 400))  # 300 tokens: long enough that vLLM caches full blocks of it
RUNNING_PROMPT = list(range(500, 532))  # the request an update lands in; no other request starts with it
TIMEOUT = httpx.Timeout(300.0)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(W0, W1): two full model directories of the same architecture, different random weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w0 = random_init_dir("smollm2-135m", torch.bfloat16, tmp_path_factory.mktemp("w0"))
    model = AutoModelForCausalLM.from_pretrained(w0, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every matrix but the embedding moves by its own spread: other greedy answers
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.add_(p.std() * torch.randn(p.shape, generator=generator))
    model = model.to(torch.bfloat16)
    w1 = tmp_path_factory.mktemp("w1")
    model.save_pretrained(w1)
    AutoTokenizer.from_pretrained(w0).save_pretrained(w1)
    return w0, w1


@pytest.fixture(scope="module")
def server(weights, tmp_path_factory) -> Iterator[RunningServer]:
    with start_server(weights[0], tmp_path_factory.mktemp("server"), *SERVER_ARGS) as running:
        yield running


@pytest.fixture(scope="module")
def fresh_w1(weights, tmp_path_factory) -> Iterator[RunningServer]:
    """A server started on W1, beside the module's server: what an update to W1 must make that one answer."""
    with start_server(weights[1], tmp_path_factory.mktemp("fresh"), *SERVER_ARGS) as fresh:
        yield fresh


def generate(server: RunningServer, token_ids: list[int], **sampling) -> dict:
    body = {"model": "tiny", "token_ids": token_ids, "sampling_params": {"logprobs": 1, **sampling}}
    response = httpx.post(f"{server.base_url}/inference/v1/generate", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def greedy(server: RunningServer, token_ids: list[int], n: int = 24) -> list[int]:
    return generate(server, token_ids, temperature=0.0, max_tokens=n, ignore_eos=True)["token_ids"]


def update(server: RunningServer, path: Path, step: int) -> None:
    response = httpx.post(f"{server.base_url}/admin/update_weights", json={"path": str(path), "step": step},
                          headers=server.admin_headers(), timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    assert response.json()["policy_version"] == step


def test_chat(server: RunningServer):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "seed": 3}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert isinstance(choice["message"]["content"], str) and choice["policy_versions"] == [0]
    assert 1 <= response.json()["usage"]["completion_tokens"] <= 8
    again = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]  # seeded


def test_streaming_chat(server: RunningServer):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"


def test_token_route_logprobs_match_transformers(server: RunningServer, weights):
    from transformers import AutoModelForCausalLM

    choice = generate(server, PROMPT[:40], temperature=1.0, max_tokens=32, ignore_eos=True)
    tokens = choice["token_ids"]
    served = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
    assert len(tokens) == 32 and choice["token_policy_versions"] == [0] * 32
    model = AutoModelForCausalLM.from_pretrained(weights[0], dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT[:40] + tokens], device="cuda")).logits[0, 39:-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1)
    difference = (served - expected.cpu()).abs()
    print(f"logprob |vLLM - transformers|: mean {difference.mean():.4f} max {difference.max():.4f}")
    assert difference.mean() < 0.1 and difference.max() < 0.5  # bfloat16 server, float32 reference


def test_update_while_a_request_runs_continues_it_under_the_new_weights(server: RunningServer, weights, fresh_w1):
    """The update lands while a greedy request decodes: vLLM preempts it and recomputes its KV under W1. Its tokens
    before the update are W0's greedy ones (stamped 0), the rest are W1's greedy continuation of exactly those
    (stamped 1): a token dropped or repeated at the resume, or a KV block of W0 reused, would change them."""
    w0_start = greedy(server, RUNNING_PROMPT, n=32)  # also caches the prompt's blocks under W0
    assert greedy(server, PROMPT) != greedy(fresh_w1, PROMPT)  # caches PROMPT's blocks under W0 too
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, server, RUNNING_PROMPT, temperature=0.0, max_tokens=3000, ignore_eos=True)
        time.sleep(1.0)  # decoding by now; 3000 tokens take several seconds
        assert not running.done()
        update(server, weights[1], step=1)
        choice = running.result()
    tokens, versions = choice["token_ids"], choice["token_policy_versions"]
    switch = versions.index(1) if 1 in versions else len(versions)
    assert 0 < switch < len(tokens) and versions == [0] * switch + [1] * (len(tokens) - switch)
    assert choice["policy_versions"] == [0, 1]
    assert tokens[: min(switch, 32)] == w0_start[: min(switch, 32)]
    assert tokens[switch : switch + 16] == greedy(fresh_w1, RUNNING_PROMPT + tokens[:switch], n=16)
    assert greedy(server, PROMPT) == greedy(fresh_w1, PROMPT)  # no block computed by W0 was reused
    assert greedy(server, [1, 2, 3, 4]) == greedy(fresh_w1, [1, 2, 3, 4])
    assert "did not reset its prefix cache" not in server.log()


def test_shared_buffer_update_equals_a_fresh_load(server: RunningServer, weights, fresh_w1, tmp_path):
    """The trainer's side of weight_transfer = shared in this process: W1 into a CUDA buffer, published as step 2."""
    from safetensors.torch import load_file

    from primerl.transport.shared import SharedSegment, read_applied

    tensors = {k: v.cuda() for f in sorted(weights[1].glob("*.safetensors")) for k, v in load_file(f).items()}
    segment = SharedSegment(tmp_path, [(name, tuple(t.shape)) for name, t in tensors.items()], torch.bfloat16,
                            torch.device("cuda", 0))
    try:
        update(server, weights[0], step=1)  # back to W0 from the filesystem first: the buffer must change things
        assert greedy(server, PROMPT) != greedy(fresh_w1, PROMPT)
        segment.fill(tensors)
        update(server, segment.publish(2), step=2)
        assert read_applied(tmp_path) == 2
        assert greedy(server, PROMPT) == greedy(fresh_w1, PROMPT)
    finally:
        segment.close()


def test_sleep_mode_frees_the_gpu_and_takes_an_update_while_asleep(weights, fresh_w1, tmp_path):
    """`vllm.sleep_level = 1`: /admin/pause releases the weights and the KV cache (GPU memory a colocated trainer can
    use); a request sent while asleep waits; a weight update while asleep wakes the weights alone, so the request
    still waits (on vLLM before 0.26 that partial wake resumed generation into the released KV cache: the server
    refuses sleep mode there); /admin/resume serves the new weights, to the waiting request too."""
    args = [*SERVER_ARGS, "--vllm.sleep_level=1"]
    if vllm_compat.check_installed() < vllm_compat.FIXED_RESET_AND_WAKE:
        refused = subprocess.run([sys.executable, "-m", "primerl.cli", "inference", "--model.name", str(weights[0]),
                                  *args], capture_output=True, text=True, timeout=300, check=False)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.strip().count("\n") == 0 and "vllm.sleep_level = 1 needs vllm" in refused.stderr
        return
    with start_server(weights[0], tmp_path / "sleepy", *args) as sleepy:
        awake_free, _ = torch.cuda.mem_get_info()
        paused = httpx.post(f"{sleepy.base_url}/admin/pause", headers=sleepy.admin_headers(), timeout=TIMEOUT)
        assert paused.status_code == 200 and paused.json()["paused"]
        asleep_free, _ = torch.cuda.mem_get_info()
        print(f"sleep level 1 freed {(asleep_free - awake_free) / 2**30:.1f} GiB")
        assert asleep_free - awake_free > 10 * 2**30  # the KV cache of a 0.25 share of the GPU, at least
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(greedy, sleepy, PROMPT)
            time.sleep(1.0)
            assert not waiting.done()
            update(sleepy, weights[1], step=1)
            time.sleep(1.0)
            assert not waiting.done()  # still paused with the KV cache released
            resumed = httpx.post(f"{sleepy.base_url}/admin/resume", headers=sleepy.admin_headers(), timeout=TIMEOUT)
            assert resumed.status_code == 200 and not resumed.json()["paused"]
            assert waiting.result() == greedy(fresh_w1, PROMPT)
        assert greedy(sleepy, PROMPT) == greedy(fresh_w1, PROMPT)
        assert greedy(sleepy, [1, 2, 3, 4]) == greedy(fresh_w1, [1, 2, 3, 4])
