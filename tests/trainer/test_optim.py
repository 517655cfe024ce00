"""The optimizer: its state allocated before the first step changes nothing that step or later ones compute."""

import torch

from primerl.config.common import ModelConfig
from primerl.config.trainer import LoraConfig, OptimizerConfig, TrainingConfig
from primerl.trainer.dist import DistInfo
from primerl.trainer.model import build_policy
from primerl.trainer.optim import allocate_state, build_optimizer


def tiny_policy_and_optimizer():
    policy, _ = build_policy(ModelConfig(name="tiny"), TrainingConfig(), LoraConfig(), torch.device("cpu"), DistInfo())
    return policy, build_optimizer(policy, OptimizerConfig(lr=1e-3, weight_decay=0.1))


def set_gradients(policy, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in policy.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def test_allocated_state_gives_the_same_steps_as_torchs_lazy_state():
    lazy_policy, lazy = tiny_policy_and_optimizer()
    early_policy, early = tiny_policy_and_optimizer()
    allocate_state(early)
    assert len(early.state) == len(list(early_policy.parameters())) and not lazy.state
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in early.state.values())
    for step in range(3):
        for policy, optimizer in ((lazy_policy, lazy), (early_policy, early)):
            set_gradients(policy, step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for (name, a), b in zip(lazy_policy.named_parameters(), early_policy.parameters(), strict=True):
            assert torch.equal(a, b), (step, name)
        for a, b in zip(lazy.state.values(), early.state.values(), strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_allocating_keeps_a_state_that_exists():
    policy, optimizer = tiny_policy_and_optimizer()
    set_gradients(policy, 0)
    optimizer.step()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    allocate_state(optimizer)  # e.g. after a resume loaded the checkpoint's state
    for param, state in optimizer.state.items():
        assert float(state["step"]) == 1
        assert all(torch.equal(value, before[id(param)][key]) for key, value in state.items())
