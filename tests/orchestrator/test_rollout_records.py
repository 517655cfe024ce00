"""What is reported per rollout (eval's results.json, the orchestrator's step metrics): a rollout cut into several
samples counts once; its turns, the taskset's metrics, its completion length and truncation are kept."""

from __future__ import annotations

from dataclasses import replace

from primerl.orchestrator.verifiers_bridge import RolloutSample, rollout_means, rollout_records


def sample(trace: str, completion: int, truncated: bool, turns: int = 3, metrics=None, error=None) -> RolloutSample:
    prompt = 4
    return RolloutSample(env="wordle", task_id="t", trace_id=trace, input_ids=list(range(prompt + completion)),
                  loss_mask=[0] * prompt + [1] * completion, inference_logprobs=[0.0] * (prompt + completion),
                  prompt_len=prompt, reward=0.5, rewards={"correct": 0.5}, policy_versions=(0, 0), num_turns=turns,
                  is_truncated=truncated, stop_condition="max_turns" if truncated else "agent_completed",
                  error=error, metrics=metrics if metrics is not None else {"num_guesses": float(turns)})


def test_a_rollout_cut_into_branches_counts_once():
    samples = [  # rollout a: truncated, cut into three branches; rollout b: one sample, not truncated
        sample("a", 10, True), sample("a", 30, True), sample("a", 20, True),
        sample("b", 6, False, turns=1, metrics={"num_guesses": 1.0, "won": 1.0}, error="Timeout: slow\nline two"),
    ]
    records = rollout_records(samples)
    assert [r["completion_len"] for r in records] == [30, 6]
    assert [r["turns"] for r in records] == [3, 1] and [r["truncated"] for r in records] == [True, False]
    assert records[1]["metrics"] == {"num_guesses": 1.0, "won": 1.0} and "\n" not in records[1]["error"]
    means = rollout_means(records)
    assert means["rollouts"] == 2
    assert means["truncated_frac"] == 0.5  # per branch it would read 0.75
    assert means["completion_len_mean"] == 18 and means["completion_len_max"] == 30
    assert means["turns_mean"] == 2 and means["turns_max"] == 3
    assert means["metric/num_guesses"] == 2.0 and means["metric/won"] == 1.0  # over the rollouts that report it


def test_without_token_ids_the_completion_length_is_what_the_server_reported():
    no_tokens = {"input_ids": [], "loss_mask": [], "inference_logprobs": [], "prompt_len": 0}
    chat = replace(sample("c", 0, False), **no_tokens, generated_tokens=12)
    unknown = replace(sample("d", 0, False), **no_tokens)
    records = rollout_records([chat, unknown])
    assert [r["completion_len"] for r in records] == [12, None]
    assert rollout_means(records)["completion_len_mean"] == 12


def test_no_rollouts_report_nothing():
    assert rollout_means([]) == {"rollouts": 0, "turns_mean": None, "turns_max": None, "completion_len_mean": None,
                                 "completion_len_max": None, "truncated_frac": None}
