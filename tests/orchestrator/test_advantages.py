import math

import pytest

from primerl.orchestrator.advantages import group_mean_baseline, grpo, is_zero_advantage, load_advantage_fn


def test_group_mean_baseline_centres_rewards():
    assert group_mean_baseline([1.0, 0.0, 0.5, 0.5]) == [0.5, -0.5, 0.0, 0.0]
    assert group_mean_baseline([]) == []


def test_grpo_divides_by_the_group_std():
    advantages = grpo([1.0, 0.0, 1.0, 0.0])  # mean 0.5, population std 0.5
    assert advantages == pytest.approx([1.0, -1.0, 1.0, -1.0], rel=1e-5)
    assert grpo([0.3, 0.3]) == [0.0, 0.0]  # no spread: eps keeps it finite


def test_zero_advantage_groups_are_detected():
    assert is_zero_advantage(group_mean_baseline([0.7, 0.7, 0.7]))
    assert not is_zero_advantage(group_mean_baseline([0.7, 0.7, 0.71]))


def test_advantage_functions_load_by_import_path_with_kwargs():
    fn = load_advantage_fn("primerl.orchestrator.advantages:grpo", {"eps": 1.0})
    assert fn([1.0, 0.0]) == pytest.approx([0.5 / 1.5, -0.5 / 1.5])
    assert load_advantage_fn("math:fsum")  # any callable by path


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon", "must look like"),
        ("primerl.orchestrator.advantages:missing", "cannot load"),
        ("no_such_module_xyz:fn", "cannot load"),
    ],
)
def test_bad_advantage_paths_are_named_in_the_error(path, message):
    with pytest.raises(ValueError, match=message):
        load_advantage_fn(path)


def test_an_advantage_function_returning_the_wrong_count_is_an_error():
    fn = load_advantage_fn("builtins:sorted")  # returns as many values as it gets: fine
    assert fn([2.0, 1.0]) == [1.0, 2.0]
    short = load_advantage_fn("math:fsum")  # returns a float, not a list
    with pytest.raises(TypeError):
        short([1.0, math.pi])
