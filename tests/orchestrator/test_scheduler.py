import pytest

from primerl.orchestrator.scheduler import PolicyBound


def test_synchronous_bound_opens_one_step_per_policy_version():
    bound = PolicyBound(max_async_steps=0, off_policy_limit=0)
    assert bound.min_version(5) == 5
    assert bound.last_step(5) == 5
    # holding version 4 while step 5 is next: nothing may start
    assert bound.launch_budget(4, 5, tasks_per_step=3, in_flight=0, ready=0, max_in_flight=None) == 0
    assert bound.launch_budget(5, 5, tasks_per_step=3, in_flight=1, ready=1, max_in_flight=None) == 1


def test_one_step_ahead_may_fill_two_steps_from_one_version():
    bound = PolicyBound(max_async_steps=1, off_policy_limit=1)
    assert bound.min_version(0) == 0 and bound.min_version(3) == 2
    assert bound.launch_budget(0, 0, tasks_per_step=2, in_flight=0, ready=0, max_in_flight=None) == 4
    assert bound.launch_budget(0, 1, tasks_per_step=2, in_flight=1, ready=0, max_in_flight=None) == 1
    assert bound.launch_budget(0, 2, tasks_per_step=2, in_flight=0, ready=0, max_in_flight=None) == 0
    assert bound.launch_budget(1, 1, tasks_per_step=2, in_flight=0, ready=0, max_in_flight=3) == 3


def test_only_the_first_batch_is_generated_until_it_is_written():
    bound = PolicyBound(max_async_steps=1, off_policy_limit=1)
    assert bound.launch_budget(0, 0, tasks_per_step=2, in_flight=0, ready=0, max_in_flight=None, first_batch=True) == 2
    assert bound.launch_budget(0, 0, tasks_per_step=2, in_flight=1, ready=1, max_in_flight=None, first_batch=True) == 0
    # a resumed run's first batch: the same, from wherever the run resumes
    assert bound.launch_budget(3, 3, tasks_per_step=2, in_flight=0, ready=0, max_in_flight=None, first_batch=True) == 2
    # nothing opens that the policy version does not allow
    assert bound.launch_budget(1, 3, tasks_per_step=2, in_flight=0, ready=0, max_in_flight=None, first_batch=True) == 0


def test_freshness_uses_the_off_policy_limit():
    bound = PolicyBound(max_async_steps=1, off_policy_limit=2)
    assert bound.is_fresh(step=5, oldest_version=3)
    assert not bound.is_fresh(step=5, oldest_version=2)


def test_an_off_policy_limit_below_the_async_bound_is_rejected():
    with pytest.raises(ValueError):
        PolicyBound(max_async_steps=2, off_policy_limit=1)
