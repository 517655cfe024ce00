"""What runs of the vLLM adapter without vLLM: the version gate (including the vLLM every image's lock pins), what
each version needs, the wake-up reading, and the logprob extraction that must never invent a value for a sampled
token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from primerl.inference.engines.vllm import sampled_logprobs
from primerl.inference.engines.vllm_compat import (
    UnsupportedVLLM,
    check_sleep_mode,
    check_version,
    engine_overrides,
    fully_awake,
)
from primerl.launch.images import PROJECT_ROOT, VARIANTS, locked_versions

IMAGES_WITH_VLLM = [variant for variant in VARIANTS.values() if "VLLM_VERSION" in variant.args(PROJECT_ROOT)]


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.19.0", (0, 19)), ("0.25.9", (0, 25)), ("0.26.0", (0, 26)), ("0.32.0", (0, 32)), ("0.32.0+cu130", (0, 32)),
     ("0.29.1rc1.dev5+g1234", (0, 29))],
)
def test_supported_versions(version, expected):
    assert check_version(version) == expected


@pytest.mark.parametrize("version", ["0.18.1", "0.33.0", "1.0.0", "dev"])
def test_other_versions_are_refused_in_one_line(version):
    with pytest.raises(UnsupportedVLLM) as refused:
        check_version(version)
    assert "\n" not in str(refused.value)


def test_the_images_with_vllm_are_the_cuda_images():
    assert sorted(variant.name for variant in IMAGES_WITH_VLLM) == ["cuda", "cuda12"]


@pytest.mark.parametrize("variant", IMAGES_WITH_VLLM, ids=lambda variant: variant.name)
def test_every_image_bundles_a_vllm_the_adapter_accepts(variant):
    """The vllm each image's lock pins (the image installs it with the gpu extra) is one the engine runs."""
    [version] = locked_versions(PROJECT_ROOT / variant.project / "uv.lock")["vllm"]
    assert check_version(version) >= (0, 19)


def test_before_0_26_the_engine_runs_without_async_scheduling():
    assert engine_overrides((0, 19)) == engine_overrides((0, 25)) == {"async_scheduling": False}
    assert engine_overrides((0, 26)) == engine_overrides((0, 32)) == {}


def test_sleep_mode_is_refused_in_one_line_before_0_26():
    with pytest.raises(UnsupportedVLLM) as refused:
        check_sleep_mode((0, 19), 1)
    assert "\n" not in str(refused.value) and "vllm.sleep_level = 1 needs vllm 0.26" in str(refused.value)
    check_sleep_mode((0, 19), 0)
    check_sleep_mode((0, 26), 1)
    check_sleep_mode((0, 32), 1)


def test_wake_up_results_of_both_versions():
    assert fully_awake(None)  # 0.19 and 0.26 report nothing
    assert fully_awake(True) and not fully_awake(False)  # 0.32 says whether every allocation is resident


def logprob(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value)


def test_sampled_logprobs_are_read_per_position():
    positions = [{5: logprob(-0.5)}, {7: logprob(-1.25), 9: logprob(-0.1)}]
    assert sampled_logprobs([5, 7], positions, 0, "r") == [-0.5, -1.25]
    assert sampled_logprobs([], None, 3, "r") == []


@pytest.mark.parametrize(
    ("token_ids", "positions", "message"),
    [
        ([5], None, "0 logprobs for 1 sampled tokens"),
        ([5, 7], [{5: logprob(-0.5)}], "1 logprobs for 2 sampled tokens"),
        ([5, 7], [{5: logprob(-0.5)}, {9: logprob(-0.1)}], "no logprob for sampled token 7 at completion position 4"),
        ([5], [None], "no logprob for sampled token 5"),
    ],
)
def test_a_missing_logprob_fails_the_request(token_ids, positions, message):
    with pytest.raises(RuntimeError, match=message):
        sampled_logprobs(token_ids, positions, 3, "req-1")
