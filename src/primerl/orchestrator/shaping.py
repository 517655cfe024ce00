"""Reward shaping (`[[orchestrator.shaping]]`): each rollout's reward is changed, before the advantage, by terms of
its length in sampled tokens (every turn's). Applied in the order listed; the reward metrics stay the task's own.

- `overlong` (DAPO's soft overlong punishment), with L = max_tokens, B = buffer_tokens and n sampled tokens:
  0 for n <= L - B, -penalty (n - (L - B)) / B for L - B < n <= L, -penalty for n > L.
- `length_penalty`: -coef n / max_tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from primerl.config.algorithms import LengthPenalty, OverlongShaping, ShapingConfig


def overlong_penalty(sampled_tokens: int, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (<= 0) of a rollout of `sampled_tokens` tokens."""
    free = max_tokens - buffer_tokens
    if sampled_tokens <= free:
        return 0.0
    if sampled_tokens <= max_tokens:
        return -penalty * (sampled_tokens - free) / buffer_tokens
    return -penalty


def length_penalty(sampled_tokens: int, max_tokens: int, coef: float) -> float:
    return -coef * sampled_tokens / max_tokens


def shaping_term(cfg: ShapingConfig, sampling_max_tokens: int) -> Callable[[int], float]:
    """The term `cfg` adds to a reward, as a function of the rollout's sampled tokens."""
    max_tokens = cfg.max_tokens or sampling_max_tokens
    if isinstance(cfg, OverlongShaping):
        buffer = cfg.buffer_tokens or max(1, max_tokens // 4)
        if buffer > max_tokens:
            raise ValueError(f"overlong shaping: buffer_tokens {buffer} is larger than max_tokens {max_tokens}")
        return lambda n: overlong_penalty(n, max_tokens, buffer, cfg.penalty)
    if isinstance(cfg, LengthPenalty):
        return lambda n: length_penalty(n, max_tokens, cfg.coef)
    raise TypeError(f"unknown shaping {cfg!r}")


class RewardShaping:
    """The listed shaping terms, added to a reward in order."""

    def __init__(self, configs: Sequence[ShapingConfig], sampling_max_tokens: int):
        self.terms = [shaping_term(cfg, sampling_max_tokens) for cfg in configs]

    def __call__(self, reward: float, sampled_tokens: int) -> float:
        for term in self.terms:
            reward += term(sampled_tokens)
        return reward
