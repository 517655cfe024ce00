"""Sampling settings that bias the importance ratio are named once, when the orchestrator starts."""

import logging

import pytest
import verifiers.v1 as vf

from primerl.config.orchestrator import OrchestratorConfig, SamplingSection
from primerl.orchestrator.loop import Orchestrator


def test_full_distribution_sampling_is_unbiased():
    assert SamplingSection().biased_ratio_warning() is None
    assert "top_k" not in SamplingSection().verifiers_fields()


@pytest.mark.parametrize(("settings", "named"), [
    ({"top_p": 0.9}, "top_p = 0.9"),
    ({"top_k": 20}, "top_k = 20"),
    ({"top_p": 0.5, "top_k": 5}, "top_p = 0.5 and top_k = 5"),
])
def test_truncated_sampling_warns_that_the_ratio_is_biased(settings, named):
    warning = SamplingSection(**settings).biased_ratio_warning()
    assert named in warning and "importance ratio" in warning and "biased" in warning


def test_top_k_reaches_the_engine_through_verifiers():
    sampling = vf.SamplingConfig(**SamplingSection(top_k=20, max_tokens=8).verifiers_fields())
    assert sampling.model_dump(exclude_none=True) == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "top_k": 20}


def test_the_orchestrator_warns_once_at_start(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="primerl.orchestrator"):
        Orchestrator(OrchestratorConfig(run_dir=tmp_path, sampling={"top_p": 0.95}))
    assert [r.getMessage() for r in caplog.records].count(
        SamplingSection(top_p=0.95).biased_ratio_warning()) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="primerl.orchestrator"):
        Orchestrator(OrchestratorConfig(run_dir=tmp_path / "b"))
    assert not caplog.records
