import pytest

from primerl.eval import summarize


def test_avg_and_pass_at_k():
    rewards = [[1.0, 0.0, 0.5], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    out = summarize(rewards, k=3, pass_threshold=1.0)
    assert out["avg@3"] == pytest.approx(4.5 / 9)
    assert out["pass@3"] == pytest.approx(2 / 3)
    assert out["pass@1"] == pytest.approx((1 / 3 + 0 + 1) / 3)


def test_threshold_decides_what_passes():
    assert summarize([[0.8, 0.2]], k=2, pass_threshold=0.75)["pass@2"] == 1.0
    assert summarize([[0.8, 0.2]], k=2, pass_threshold=0.9)["pass@2"] == 0.0


def test_no_tasks_is_an_error():
    with pytest.raises(ValueError):
        summarize([], k=1, pass_threshold=1.0)
