"""How finished groups become batches: advantages per rollout, the zero-advantage filter and its cap, stale samples,
what is written to rollouts/step_<n>/ and logged."""

from __future__ import annotations

import json

import pytest

from primerl.config.orchestrator import OrchestratorConfig
from primerl.monitor import read_metrics
from primerl.orchestrator.client import InferencePool
from primerl.orchestrator.loop import Orchestrator, PolicyTracker
from primerl.orchestrator.sampler import TaskStream
from primerl.orchestrator.steps import score_group
from primerl.orchestrator.verifiers_bridge import RolloutSample
from primerl.transport.rollouts import read_batch


def sample(trace: str, reward: float, versions=(0, 0), tokens: int = 4, error: str | None = None,
           segments=()) -> RolloutSample:
    ids = list(range(1, tokens + 1))
    mask = [0, 0] + [1] * (tokens - 2) if tokens else []
    return RolloutSample(
        env="reverse-text", task_id="t", trace_id=trace, input_ids=ids, loss_mask=mask,
        inference_logprobs=[-0.5 * m for m in mask], prompt_len=2 if tokens else 0, reward=reward, rewards={},
        policy_versions=versions, num_turns=1, is_truncated=False, stop_condition="agent_completed", error=error,
        version_segments=segments,
    )


def drawn(orchestrator, scored, draw: int | None = None):
    """`scored` as the group of a task the orchestrator drew (as `_launch` does: the next draw unless `draw` is
    given)."""
    scored.draw = orchestrator.tasks.next()[0] if draw is None else draw
    orchestrator.in_flight.add(scored.draw)
    return scored


def group(task: str, rewards: list[float], versions=(0, 0), orchestrator=None, segments=(), draw: int | None = None):
    samples = [sample(f"{task}-{i}", r, versions, segments=segments) for i, r in enumerate(rewards)]
    return drawn(orchestrator, score_group(task, samples, orchestrator.algorithm.scorer, seconds=0.1), draw)


def batch_advantages(path) -> list[float]:
    batch = read_batch(path)
    advantages: dict[int, float] = {}
    for row in range(batch.num_rows):
        for index, adv in zip(batch.arrays["sample_index"][row], batch.arrays["advantages"][row]):
            if index >= 0:
                advantages.setdefault(int(index), float(adv))
    return sorted(advantages.values())


@pytest.fixture
def orchestrator(tmp_path):
    def make(**overrides) -> Orchestrator:
        cfg = OrchestratorConfig(run_dir=tmp_path, batch={"tasks_per_step": 2, "group_size": 2, "seq_len": 16},
                                 **overrides)
        o = Orchestrator(cfg)
        pool = InferencePool(["http://127.0.0.1:9"], admin_token=None, request_timeout_s=1, retry_s=1)
        o.policy = PolicyTracker(pool, run_dir=tmp_path, poll_s=1.0)
        o.tasks = TaskStream(_Taskset(), seed=0)
        return o

    return make


class _Taskset(list):
    bounded = True

    def __init__(self):
        super().__init__(["task"])


def test_a_batch_carries_each_rollouts_advantage(orchestrator, tmp_path):
    o = orchestrator()
    o._collect(group("a", [1.0, 0.0], orchestrator=o))
    assert o._take_fresh_groups() is None  # one group of two
    o._collect(group("b", [0.25, 0.75], orchestrator=o))
    assert o._take_fresh_groups() == 0
    assert batch_advantages(tmp_path / "rollouts" / "step_0") == pytest.approx([-0.5, -0.25, 0.25, 0.5])
    assert json.loads((tmp_path / "rollouts" / "step_0" / "meta.json").read_text())["extra"]["tasks"] == ["a", "b"]
    (record,) = read_metrics(tmp_path, "orchestrator")
    assert record["reward_mean"] == pytest.approx(0.5) and record["samples"] == 4
    assert o.progress.next_step == 1


def test_steps_take_groups_in_draw_order_not_in_the_order_they_finish(orchestrator, tmp_path):
    o = orchestrator()
    draws = [o.tasks.next()[0] for _ in range(4)]
    o.in_flight.update(draws)
    o._collect(group("d3", [0.0, 1.0], orchestrator=o, draw=3))
    o._collect(group("d1", [0.0, 1.0], orchestrator=o, draw=1))
    o._collect(group("d2", [0.0, 1.0], orchestrator=o, draw=2))
    assert o._take_fresh_groups() is None  # draw 0 still running: step 0 is draws 0 and 1
    o._collect(group("d0", [0.0, 1.0], orchestrator=o, draw=0))
    assert o._take_fresh_groups() == 0
    assert o._take_fresh_groups() == 1
    steps = [json.loads((tmp_path / "rollouts" / f"step_{n}" / "meta.json").read_text())["extra"]["tasks"]
             for n in (0, 1)]
    assert steps == [["d0", "d1"], ["d2", "d3"]]


def test_zero_advantage_groups_are_dropped_until_the_cap_then_kept(orchestrator, tmp_path):
    o = orchestrator(advantage={"max_extra_groups": 1})
    o._collect(group("perfect", [1.0, 1.0], orchestrator=o))
    assert not o.ready and o.stats.groups_dropped == {"zero_advantage": 1}
    o._collect(group("hopeless", [0.0, 0.0], orchestrator=o))  # cap reached: kept
    o._collect(group("mixed", [0.0, 1.0], orchestrator=o))
    assert o._take_fresh_groups() == 0
    (record,) = read_metrics(tmp_path, "orchestrator")
    assert record["groups_dropped_zero_advantage"] == 1
    assert record["reward_mean"] == pytest.approx(3 / 6)  # the dropped perfect group still counts as seen
    assert record["batch_reward_mean"] == pytest.approx(1 / 4)


def test_zero_advantage_groups_are_kept_when_the_filter_is_off(orchestrator):
    o = orchestrator(advantage={"drop_zero_advantage": False})
    o._collect(group("same", [0.5, 0.5], orchestrator=o))
    assert len(o.ready) == 1


def test_samples_older_than_the_bound_are_dropped_and_counted(orchestrator, tmp_path):
    o = orchestrator(max_async_steps=1)
    o.progress.next_step = 3
    o._collect(group("old", [0.0, 1.0], versions=(1, 2), orchestrator=o))  # 1 < 3 - 1
    o._collect(group("fresh", [0.0, 1.0], versions=(2, 3), orchestrator=o))
    assert o._take_fresh_groups() is None
    assert [g.task_id for g in o.ready] == ["fresh"] and o.stats.samples_dropped_off_policy == 2
    o._collect(group("newer", [1.0, 0.0], versions=(3, 3), orchestrator=o))
    assert o._take_fresh_groups() == 3
    meta = json.loads((tmp_path / "rollouts" / "step_3" / "meta.json").read_text())
    assert min(s["policy_versions"][0] for s in meta["samples"]) == 2
    (record,) = read_metrics(tmp_path, "orchestrator")
    assert record["samples_dropped_off_policy"] == 2 and record["policy_lag_max"] == 1


def test_the_batch_carries_each_samples_version_runs(orchestrator, tmp_path):
    o = orchestrator(max_async_steps=1)
    o.progress.next_step = 3
    o._collect(group("spans", [0.0, 1.0], versions=(2, 3), orchestrator=o, segments=((2, 1), (3, 1))))
    o._collect(group("one", [1.0, 0.0], versions=(3, 3), orchestrator=o, segments=((3, 2),)))
    assert o._take_fresh_groups() == 3
    meta = json.loads((tmp_path / "rollouts" / "step_3" / "meta.json").read_text())
    runs = sorted(s["version_segments"] for s in meta["samples"])
    assert runs == [[[2, 1], [3, 1]], [[2, 1], [3, 1]], [[3, 2]], [[3, 2]]]
    (record,) = read_metrics(tmp_path, "orchestrator")
    assert record["samples_spanning_updates"] == 2 and record["oldest_policy_version"] == 2


def test_failed_rollouts_score_but_never_reach_the_batch_nor_the_baseline(orchestrator, tmp_path):
    o = orchestrator()
    # x-0 failed after sampling tokens: its reward (0) is no evidence about the policy
    broken = drawn(o, score_group("x", [sample("x-0", 0.0, error="ProviderError: boom"), sample("x-1", 1.0),
                                        sample("x-2", 0.0)], o.algorithm.scorer, 0.1))
    assert broken.advantages == pytest.approx({"x-1": 0.5, "x-2": -0.5})
    o._collect(broken)
    o._collect(group("y", [0.0, 1.0], orchestrator=o))
    assert o._take_fresh_groups() == 0
    assert json.loads((tmp_path / "rollouts" / "step_0" / "meta.json").read_text())["num_samples"] == 4
    assert batch_advantages(tmp_path / "rollouts" / "step_0") == pytest.approx([-0.5, -0.5, 0.5, 0.5])
    record = read_metrics(tmp_path, "orchestrator")[0]
    assert record["errors"] == 1 and record["reward_mean"] == pytest.approx(2 / 5)  # every rollout counts as seen


def test_a_group_that_lost_stale_samples_is_scored_again_over_the_rest(orchestrator, tmp_path):
    o = orchestrator(max_async_steps=1)
    o.progress.next_step = 3
    samples = [sample("m-0", 1.0, versions=(1, 2)), sample("m-1", 0.0, versions=(2, 3)),
               sample("m-2", 0.5, versions=(2, 3))]  # m-0 is older than 3 - 1: dropped
    o._collect(drawn(o, score_group("m", samples, o.algorithm.scorer, 0.1)))
    o._collect(group("n", [0.0, 1.0], versions=(3, 3), orchestrator=o))
    assert o._take_fresh_groups() == 3
    # over m-1 and m-2 alone the mean is 0.25; with the dropped m-0 it was 0.5 (advantages -0.5 and 0)
    assert batch_advantages(tmp_path / "rollouts" / "step_3") == pytest.approx([-0.5, -0.25, 0.25, 0.5])


def test_a_sample_longer_than_seq_len_is_left_out_and_counted(orchestrator, tmp_path):
    o = orchestrator()  # seq_len 16
    long = drawn(o, score_group("l", [sample("l-0", 1.0, tokens=17), sample("l-1", 0.0), sample("l-2", 0.5)],
                                o.algorithm.scorer, 0.1))
    o._collect(long)
    o._collect(group("s", [0.0, 1.0], orchestrator=o))
    assert o._take_fresh_groups() == 0
    meta = json.loads((tmp_path / "rollouts" / "step_0" / "meta.json").read_text())
    assert meta["num_samples"] == 4 and meta["num_truncated"] == 0
    # l-0 keeps its place in the baseline (its reward is real), it is only not trained on
    assert batch_advantages(tmp_path / "rollouts" / "step_0") == pytest.approx([-0.5, -0.5, 0.0, 0.5])
    assert read_metrics(tmp_path, "orchestrator")[0]["samples_too_long"] == 1


def test_a_run_of_entirely_failed_groups_stops_the_orchestrator(orchestrator):
    o = orchestrator()
    with pytest.raises(RuntimeError, match="boom"):
        for i in range(100):
            o._collect(score_group(f"t{i}", [sample(f"{i}", 0.0, tokens=0, error="boom")], o.algorithm.scorer, 0.1))
