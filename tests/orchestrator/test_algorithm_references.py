"""The orchestrator's algorithm choices against references computed independently: advantage estimators in exact
rational arithmetic (fractions) or with the statistics module, on hand-made groups — failed rollouts, all-equal
rewards, groups of one, rollouts cut into several samples; reward shaping at every edge; the filters; the per-token
advantages of distillation; the difficulty sampler's weighting and its exact resume; and the default, which must
write the very batch the configs written before advantages had a type wrote."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_batches import _Taskset, batch_advantages, drawn, sample

from primerl.config.algorithms import (
    DifficultySampler,
    DistillAdvantage,
    EqualRewardsFilter,
    GRPOAdvantage,
    LengthPenalty,
    OverlongShaping,
    ReinforceAdvantage,
    RLOOAdvantage,
    ZeroAdvantageFilter,
)
from primerl.config.orchestrator import OrchestratorConfig
from primerl.config.rl import RLConfig
from primerl.orchestrator.advantages import Scorer, grpo, rloo
from primerl.orchestrator.client import InferencePool
from primerl.orchestrator.filters import GroupFilters
from primerl.orchestrator.loop import Orchestrator, PolicyTracker
from primerl.orchestrator.sampler import DifficultyTaskSampler, TaskStream, task_sampler
from primerl.orchestrator.shaping import RewardShaping, overlong_penalty
from primerl.orchestrator.steps import score_group
from primerl.orchestrator.teacher import TeacherError, prompt_logprobs_of

REWARDS = [0.25, 1.0, 0.0, 0.75, 0.5]


def exact(values):
    return [Fraction(v) for v in values]


# ---------------------------------------------------------------------------------------------------------------------
# Estimators


@pytest.mark.parametrize("rewards", [REWARDS, [0.1, 0.2], [0.7, 0.7, 0.7], [0.3]])
def test_estimators_match_exact_references(rewards):
    r = exact(rewards)
    n = len(r)
    mean = sum(r) / n
    dr_grpo = [x - mean for x in r]
    loo = [x - (sum(r) - x) / (n - 1) for x in r] if n > 1 else [0] * n
    std = statistics.pstdev(rewards)
    cases = {
        "dr_grpo": (Scorer(OrchestratorConfig().advantage), dr_grpo),
        "rloo": (Scorer(RLOOAdvantage()), loo),
        "reinforce": (Scorer(ReinforceAdvantage(baseline=0.25)), [x - Fraction(1, 4) for x in r]),
        "grpo": (Scorer(GRPOAdvantage(eps=1e-6)), [float(a) / (std + 1e-6) for a in dr_grpo]),
    }
    samples = [sample(f"t-{i}", x) for i, x in enumerate(rewards)]
    for name, (scorer, expected) in cases.items():
        got = scorer(samples).advantages
        # abs: the float mean of equal rewards can be off by an ulp, which GRPO divides by its eps (1e-16 / 1e-6)
        assert list(got.values()) == pytest.approx([float(e) for e in expected], rel=1e-12, abs=1e-9), name


def test_all_equal_groups_carry_no_signal_under_group_baselines_only():
    samples = [sample(f"e-{i}", 0.7) for i in range(4)]
    for cfg in (OrchestratorConfig().advantage, GRPOAdvantage(), RLOOAdvantage()):
        assert all(abs(a) <= 1e-12 for a in Scorer(cfg)(samples).advantages.values()), cfg.type
    assert set(Scorer(ReinforceAdvantage())(samples).advantages.values()) == {0.7}


def test_failed_rollouts_are_out_of_every_baseline():
    # t-1 failed: every estimator must see the other four rewards only, and t-1's samples get no advantage
    samples = [sample(f"t-{i}", x, error="boom" if i == 1 else None) for i, x in enumerate(REWARDS)]
    kept = [x for i, x in enumerate(REWARDS) if i != 1]
    for cfg, fn in ((RLOOAdvantage(), rloo), (GRPOAdvantage(), grpo)):
        scored = Scorer(cfg)(samples)
        assert "t-1" not in scored.advantages and scored.sample_advantages[1] is None
        assert list(scored.advantages.values()) == pytest.approx(fn(kept), rel=1e-12)
    r = exact(kept)
    assert list(Scorer(RLOOAdvantage())(samples).advantages.values()) == pytest.approx(
        [float(x - (sum(r) - x) / 3) for x in r], rel=1e-12)


def test_a_rollout_cut_into_samples_is_one_member_of_the_baseline():
    samples = [sample("a", 1.0), sample("a", 1.0), sample("b", 0.0), sample("c", 0.5)]
    scored = Scorer(RLOOAdvantage())(samples)
    assert scored.advantages == pytest.approx({"a": 0.75, "b": -0.75, "c": 0.0})
    assert scored.sample_advantages == pytest.approx([0.75, 0.75, -0.75, 0.0])


# ---------------------------------------------------------------------------------------------------------------------
# Shaping


def test_overlong_shaping_is_daps_piecewise_penalty():
    # L = 40, B = 8: free up to 32 tokens, linear to -penalty at 40, -penalty beyond
    expected = {0: 0.0, 32: 0.0, 33: -0.5 / 8, 36: -0.5 * 4 / 8, 40: -0.5, 41: -0.5, 400: -0.5}
    for n, want in expected.items():
        assert overlong_penalty(n, 40, 8, penalty=0.5) == pytest.approx(want, abs=1e-15), n


def test_shaping_applies_in_order_to_the_rewards_before_the_estimator():
    shaping = RewardShaping([OverlongShaping(buffer_tokens=2), LengthPenalty(coef=0.2)], sampling_max_tokens=4)
    # tokens=6 samples carry 4 sampled tokens (two prompt tokens): at the limit, penalty 1; length 0.2 * 4/4
    group = [sample("x", 1.0, tokens=6), sample("y", 1.0, tokens=4)]  # y: 2 sampled tokens, no overlong penalty
    scored = Scorer(RLOOAdvantage(), shaping)(group)
    shaped = {"x": 1.0 - 1.0 - 0.2, "y": 1.0 - 0.2 * 2 / 4}
    assert scored.rewards == pytest.approx(shaped)
    assert scored.advantages == pytest.approx({"x": shaped["x"] - shaped["y"], "y": shaped["y"] - shaped["x"]})


def test_overlong_buffer_defaults_to_a_quarter_and_must_fit():
    assert RewardShaping([OverlongShaping()], 40)(1.0, 31) == pytest.approx(1.0 - 1 / 10)
    with pytest.raises(ValueError, match="buffer_tokens 50 is larger than max_tokens 40"):
        RewardShaping([OverlongShaping(buffer_tokens=50)], 40)


# ---------------------------------------------------------------------------------------------------------------------
# Filters


def scored_group(rewards, cfg=None, shaping=None, teacher=None):
    samples = [sample(f"g-{i}", r) for i, r in enumerate(rewards)]
    teacher_logprobs = {id(s): lp for s, lp in zip(samples, teacher)} if teacher else None
    return score_group("g", samples, Scorer(cfg or OrchestratorConfig().advantage, shaping), 0.0, teacher_logprobs)


def test_filters_name_the_first_that_drops_a_group():
    both = GroupFilters([ZeroAdvantageFilter(), EqualRewardsFilter()])
    assert both.dropping(scored_group([0.5, 0.5])) == "zero_advantage"
    assert both.dropping(scored_group([0.5, 0.6])) is None
    # plain REINFORCE gives an all-equal group nonzero advantages: only the reward filter sees it
    reinforce = scored_group([0.5, 0.5], ReinforceAdvantage())
    assert both.dropping(reinforce) == "equal_rewards"
    assert GroupFilters([EqualRewardsFilter(tolerance=0.2)]).dropping(scored_group([0.5, 0.6])) == "equal_rewards"
    assert GroupFilters([]).dropping(scored_group([0.5, 0.5])) is None


def test_a_distilled_group_has_signal_even_when_its_rewards_are_equal():
    teacher = [[0.0, -1.0, -0.2, -0.5]] * 2  # differs from the sampling log-probs (-0.5 on sampled tokens)
    group = scored_group([0.5, 0.5], DistillAdvantage(), teacher=teacher)
    assert GroupFilters([ZeroAdvantageFilter()]).dropping(group) is None
    same = scored_group([0.5, 0.5], DistillAdvantage(), teacher=[[0.0, 0.0, -0.5, -0.5]] * 2)
    assert GroupFilters([ZeroAdvantageFilter()]).dropping(same) == "zero_advantage"


# ---------------------------------------------------------------------------------------------------------------------
# Distillation


def test_distillation_advantage_is_the_negated_per_token_reverse_kl_plus_the_task_advantage():
    teacher = [[0.0, -3.0, -0.2, -1.1], [0.0, -0.1, -0.9, -0.4]]
    group = scored_group([1.0, 0.0], DistillAdvantage(kl_coef=0.5, reward_coef=2.0, reward_advantage="rloo"),
                         teacher=teacher)
    rloo_advantage = {0: 1.0, 1: -1.0}
    for i, advantages in enumerate(group.sample_advantages):
        expected = [0.0, 0.0] + [0.5 * (t - (-0.5)) + 2.0 * rloo_advantage[i] for t in teacher[i][2:]]
        assert advantages == pytest.approx(expected, rel=1e-12)  # prompt tokens (mask 0) get nothing


def test_teacher_responses_are_read_token_by_token():
    body = {"prompt_logprobs": [None, {"7": {"logprob": -0.5}}, {"9": {"logprob": -2.0, "rank": 3}}]}
    assert prompt_logprobs_of(body, [1, 7, 9], "t") == [0.0, -0.5, -2.0]
    with pytest.raises(TeacherError, match="no log-prob for token 2"):
        prompt_logprobs_of({"prompt_logprobs": [None, {"7": {"logprob": -0.5}}, {"8": {"logprob": -1}}]}, [1, 7, 9],
                           "t")
    with pytest.raises(TeacherError, match="for 3 tokens"):
        prompt_logprobs_of({"choices": []}, [1, 7, 9], "t")


# ---------------------------------------------------------------------------------------------------------------------
# The difficulty sampler


@dataclass
class Taskset:
    items: list
    bounded: bool = True

    def __iter__(self):
        return iter(self.items)


@dataclass
class FinishedGroup:
    draw: int
    samples: list


def finished(draw, rewards, failed=()):
    return FinishedGroup(draw, [sample(f"{draw}-{i}", r, error="boom" if i in failed else None)
                                for i, r in enumerate(rewards)])


def test_tasks_every_rollout_solves_or_none_solves_are_drawn_less():
    cfg = DifficultySampler(easy_weight=0.1, hard_weight=0.2)
    sampler = DifficultyTaskSampler(Taskset(["easy", "hard", "mixed"]), cfg, seed=1)
    outcomes = {"easy": [1.0, 1.0], "hard": [0.0, 0.0], "mixed": [1.0, 0.0]}
    for _ in range(30):  # let every task be seen
        draw, task = sampler.next()
        sampler.observe(finished(draw, outcomes[task]))
    counts = Counter(sampler.next()[1] for _ in range(4000))
    # weights 0.1 : 0.2 : 1 of 1.3
    assert counts["easy"] / 4000 == pytest.approx(0.1 / 1.3, abs=0.02)
    assert counts["hard"] / 4000 == pytest.approx(0.2 / 1.3, abs=0.025)
    assert sampler.metrics() == {"tasks_easy": 1, "tasks_hard": 1, "tasks_unseen": 0}


def test_failed_rollouts_do_not_decide_difficulty_and_the_newest_draw_wins():
    sampler = DifficultyTaskSampler(Taskset(["t"]), DifficultySampler(solved_at=0.5), seed=0)
    first, second = sampler.next()[0], sampler.next()[0]
    sampler.observe(finished(second, [1.0, 0.0]))
    sampler.observe(finished(first, [1.0, 1.0]))  # an older draw, finishing later: does not overwrite
    assert sampler.weight(0) == 1.0
    third = sampler.next()[0]
    sampler.observe(finished(third, [0.9, 0.0], failed=(1,)))  # the failed rollout's 0 is not "unsolved"
    assert sampler.metrics()["tasks_easy"] == 1


def test_difficulty_sampler_resumes_exactly_from_its_checkpointed_state():
    cfg = DifficultySampler(easy_weight=0.05, hard_weight=0.3)
    tasks = Taskset([f"task{i}" for i in range(7)])
    reward = {f"task{i}": [float(i % 3 == 0)] * 2 if i % 2 else [1.0, 0.0] for i in range(7)}
    original = DifficultyTaskSampler(tasks, cfg, seed=5)
    in_flight = []
    for step in range(6):  # draws finish out of order; the last two of each step stay in flight
        draws = [original.next() for _ in range(3)]
        for draw, task in reversed(draws[:1] + draws[2:]):
            original.observe(finished(draw, reward[task]))
        in_flight = [draws[1][0]] + in_flight[:1]
    state = json.loads(json.dumps(original.state(sorted(in_flight))))  # through the checkpoint file
    resumed = task_sampler(cfg, tasks, 5, drawn=original.drawn, redo=sorted(in_flight), state=state)
    assert [resumed.next() for _ in in_flight] == [(d, original._tasks[original._task_of_draw[d]])
                                                   for d in sorted(in_flight)]
    for draw in sorted(in_flight):  # the redone groups finish as the originals would have
        task = original._tasks[original._task_of_draw[draw]]
        original.observe(finished(draw, reward[task]))
        resumed.observe(finished(draw, reward[task]))
    ahead = []
    for _ in range(20):
        a, b = original.next(), resumed.next()
        ahead.append(a)
        assert a == b
        original.observe(finished(a[0], reward[a[1]]))
        resumed.observe(finished(b[0], reward[b[1]]))
    assert len({task for _, task in ahead}) > 1
    fresh = DifficultyTaskSampler(tasks, cfg, seed=5, drawn=original.drawn - 20)  # without the state: other draws
    assert [fresh.next() for _ in range(20)] != ahead


def test_the_difficulty_sampler_needs_a_finite_taskset_and_its_redo_tasks():
    with pytest.raises(ValueError, match="finite taskset"):
        task_sampler(DifficultySampler(), Taskset([], bounded=False), 0)
    with pytest.raises(ValueError, match="draws \\[3\\]"):
        task_sampler(DifficultySampler(), Taskset(["a"]), 0, drawn=4, redo=[3], state={})
    assert isinstance(task_sampler(OrchestratorConfig().sampler, Taskset(["a"]), 0), TaskStream)


def test_the_orchestrator_checkpoint_carries_the_sampler_state(tmp_path):
    cfg = OrchestratorConfig(run_dir=tmp_path, batch={"tasks_per_step": 1, "group_size": 2, "seq_len": 16},
                             sampler={"type": "difficulty"})
    o = Orchestrator(cfg)
    o.policy = PolicyTracker(InferencePool(["http://127.0.0.1:9"], admin_token=None, request_timeout_s=1, retry_s=1),
                             run_dir=tmp_path, poll_s=1.0)
    o.tasks = task_sampler(cfg.sampler, Taskset(["a", "b"]), 0)
    for _ in range(2):
        group = score_group("t", [sample("x-0", 1.0), sample("x-1", 0.0)], o.algorithm.scorer, 0.1)
        o._collect(drawn(o, group))
    o.tasks.next()  # a third draw, still in flight
    o.in_flight.add(2)
    assert o._take_fresh_groups() == 0
    saved = json.loads((tmp_path / "checkpoints" / "step_1" / "orchestrator" / "state.json").read_text())
    assert saved["tasks_in_flight"] == [1, 2]
    assert sorted(saved["sampler"]["task_of_draw"]) == ["1", "2"] and saved["sampler"]["outcome"]


# ---------------------------------------------------------------------------------------------------------------------
# The default stays what it was; configs written before keep loading


def _write_one_batch(tmp_path, **overrides):
    cfg = OrchestratorConfig(run_dir=tmp_path, batch={"tasks_per_step": 2, "group_size": 3, "seq_len": 16},
                             **overrides)
    o = Orchestrator(cfg)
    o.policy = PolicyTracker(InferencePool(["http://127.0.0.1:9"], admin_token=None, request_timeout_s=1, retry_s=1),
                             run_dir=tmp_path, poll_s=1.0)
    o.tasks = TaskStream(_Taskset(), seed=0)
    groups = [("a", [0.1, 0.7, 0.7]), ("same", [0.3, 0.3, 0.3]), ("b", [1.0, 0.0, 0.25])]
    for name, rewards in groups:
        samples = [sample(f"{name}-{i}", r, error="boom" if (name, i) == ("b", 2) else None)
                   for i, r in enumerate(rewards)]
        o._collect(drawn(o, score_group(name, samples, o.algorithm.scorer, 0.1)))
    assert o._take_fresh_groups() == 0
    return tmp_path / "rollouts" / "step_0"


def test_the_default_writes_the_batch_the_legacy_group_mean_config_wrote(tmp_path):
    default = _write_one_batch(tmp_path / "default")
    legacy = _write_one_batch(tmp_path / "legacy", advantage={
        "path": "primerl.orchestrator.advantages:group_mean_baseline", "drop_zero_advantage": True})
    a, b = (load_file(d / "rank_0.safetensors") for d in (default, legacy))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
    meta = [json.loads((d / "meta.json").read_text()) for d in (default, legacy)]
    assert meta[0]["extra"]["tasks"] == meta[1]["extra"]["tasks"] == ["a", "b"]  # "same" was dropped
    r = exact([0.1, 0.7, 0.7])
    expected = sorted([float(x - sum(r) / 3) for x in r] + [0.5, -0.5])  # b-2 failed: b is scored over b-0, b-1
    assert batch_advantages(default) == pytest.approx(expected, rel=1e-7)  # stored as float32


@pytest.mark.parametrize(("legacy", "filters", "extra"), [
    ({"drop_zero_advantage": False}, [], None),
    ({"max_extra_groups": 3, "path": "primerl.orchestrator.advantages:grpo"}, ["zero_advantage"], 3),
    ({"drop_zero_advantage": "true"}, ["zero_advantage"], None),
])
def test_configs_with_the_old_filter_keys_still_load(legacy, filters, extra):
    for cfg in (OrchestratorConfig(advantage=legacy), RLConfig(orchestrator={"advantage": legacy}).orchestrator):
        assert [f.type for f in cfg.filters] == filters and cfg.batch.max_extra_groups == extra
    with pytest.raises(ValueError, match="both set"):
        OrchestratorConfig(advantage={"drop_zero_advantage": False}, filters=[])


def test_distillation_is_configured_with_a_teacher_or_refused():
    with pytest.raises(ValueError, match="needs teacher.base_url"):
        OrchestratorConfig(advantage={"type": "distill"})
    cfg = RLConfig(orchestrator={"advantage": {"type": "distill", "reward_coef": 0.5}},
                   teacher={"model": {"name": "tiny"}, "max_batch_size": 4})
    _, orchestrator, _ = cfg.process_configs(cfg.assign_devices(0), "http://127.0.0.1:1", teacher_url="http://t:2")
    assert (orchestrator.teacher.base_url, orchestrator.teacher.model) == ("http://t:2", "tiny")
    teacher = cfg.teacher_config(cfg.assign_devices(0))
    assert teacher.model.name == "tiny" and teacher.max_batch_size == 4 and teacher.threads is not None
    assert math.isclose(orchestrator.advantage.reward_coef, 0.5)
