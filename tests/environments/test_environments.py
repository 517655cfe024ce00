"""The shipped environments: loadable by id, data pinned and verified, rewards and game rules right."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import verifiers.v1 as vf

from primerl.orchestrator.envkit import ChatHarness, DataIntegrityError, Tool, read_pinned
from primerl.orchestrator.verifiers_bridge import load_env

ENVS = {
    # env id -> (module, a pinned data file)
    "reverse-text": ("reverse_text", "data/words.txt"),
    "alphabet-sort": ("alphabet_sort", "data/names.txt"),
    "wordle": ("wordle", "data/words.txt"),
    "math-sanity": ("math_sanity", "data/problems.jsonl"),
    "wiki-search": ("wiki_search", "data/articles.jsonl"),
}


@pytest.mark.parametrize("env_id", sorted(ENVS))
def test_loads_by_id_with_the_in_process_harness(env_id: str) -> None:
    env = load_env(env_id)
    tasks = list(env.taskset)
    assert len(tasks) >= 30
    assert len({task.key for task in tasks}) == len(tasks)
    assert all(task.data.prompt and task.data.system_prompt for task in tasks)
    assert vf.default_harness_id(env_id) == env_id
    assert isinstance(vf.load_harness(vf.default_agent_harness(env_id)), ChatHarness)


def test_generated_splits_are_reproducible_and_seeded() -> None:
    first = [t.data.text for t in load_env("reverse-text").taskset]
    assert first == [t.data.text for t in load_env("reverse-text").taskset]
    assert first != [t.data.text for t in load_env("reverse-text", seed=1).taskset]


@pytest.mark.parametrize("env_id", sorted(ENVS))
def test_a_tampered_data_file_is_refused(env_id: str, tmp_path: Path) -> None:
    module, data_file = ENVS[env_id]
    copy = tmp_path / module
    shutil.copytree(resources.files(module), copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / data_file, "a") as f:
        f.write("\n")
    code = f"import verifiers.v1 as vf; list(vf.load_environment(vf.resolve_env_config({{'taskset': {{'id': {env_id!r}}}}})).taskset)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "DataIntegrityError" in result.stderr and f"{module}/{data_file}" in result.stderr


def test_read_pinned_checks_the_hash() -> None:
    from wordle import WORDS_SHA256

    assert read_pinned("wordle", "data/words.txt", WORDS_SHA256).split()[0] == b"about"
    with pytest.raises(DataIntegrityError, match="wordle/data/words.txt"):
        read_pinned("wordle", "data/words.txt", "0" * 64)


def test_reverse_text_reward() -> None:
    from reverse_text import reversal_similarity

    assert reversal_similarity(" kcor eulb \n", "blue rock") == 1.0
    assert reversal_similarity("blue rock", "blue rock") < 0.5
    assert reversal_similarity("", "blue rock") == 0.0


def test_reverse_text_words_mode() -> None:
    from reverse_text import SYSTEM_PROMPT_WORDS, reversal_similarity, reversed_text

    assert reversed_text("the blue rock", "words") == "rock blue the"
    assert reversal_similarity(" rock blue the\n", "the blue rock", "words") == 1.0
    assert reversal_similarity("the blue rock", "the blue rock", "words") < 1.0
    assert reversal_similarity("kcor eulb eht", "the blue rock", "words") < 0.5  # letters reversed: not this task
    chars, words = list(load_env("reverse-text").taskset), list(load_env("reverse-text", reverse="words").taskset)
    # the same phrases (the pinned split is checked in both modes); only the instruction and the target differ
    assert [t.data.text for t in chars] == [t.data.text for t in words]
    assert words[0].data.system_prompt == SYSTEM_PROMPT_WORDS and words[0].data.reverse == "words"
    assert chars[0].data.system_prompt != SYSTEM_PROMPT_WORDS and chars[0].data.reverse == "chars"


def test_environment_settings_it_refuses_are_one_line_naming_the_arg() -> None:
    from primerl.orchestrator.verifiers_bridge import EnvConfigError

    with pytest.raises(EnvConfigError) as refused:
        load_env("reverse-text", revers="words")
    assert str(refused.value) == "environment 'reverse-text': env.args.revers: Extra inputs are not permitted (got 'words')"
    with pytest.raises(EnvConfigError, match=r"env.args.reverse: Input should be 'chars' or 'words' \(got 'letters'\)"):
        load_env("reverse-text", reverse="letters")


def test_reverse_text_checks_the_pinned_split_in_words_mode(monkeypatch) -> None:
    import reverse_text

    monkeypatch.setattr(reverse_text, "DEFAULT_SPLIT_SHA256", "0" * 64)
    with pytest.raises(DataIntegrityError, match="ReverseTextConfig"):
        list(load_env("reverse-text", reverse="words").taskset)
    assert len(list(load_env("reverse-text", reverse="words", seed=1).taskset)) == 1000  # another split: not pinned


def test_alphabet_sort_scores_every_turn() -> None:
    from alphabet_sort import parse_names, turn_scores

    batches = [["Omar", "Ada", "Kai"], ["Bruno"], ["Zara", "Ida"]]
    perfect = ["Ada\nKai\nOmar", "1. Ada\n2. Bruno\n3. Kai\n4. Omar", "- Ada\n- Bruno\n- Ida\n- Kai\n- Omar\n- Zara"]
    assert turn_scores(perfect, batches) == [1.0, 1.0, 1.0]
    assert parse_names("Ada, Kai\n* Omar") == ["Ada", "Kai", "Omar"]
    unsorted_then_silent = ["Omar\nAda\nKai"]
    scores = turn_scores(unsorted_then_silent, batches)
    assert 0 < scores[0] < 1 and scores[1:] == [0.0, 0.0]


def test_alphabet_sort_tasks_reveal_new_names_each_turn() -> None:
    for task in list(load_env("alphabet-sort").taskset)[:50]:
        batches = task.data.batches
        assert 3 <= len(batches) <= 5
        names = [name for batch in batches for name in batch]
        assert len(names) == len(set(names))
        assert all(name in task.data.prompt for name in batches[0])


def test_wordle_feedback_handles_repeated_letters() -> None:
    from wordle import feedback, game_reward, parse_guess, turn_message

    assert feedback("crane", "crane") == "GGGGG"
    assert feedback("abbey", "babes") == "YYGGX"
    assert feedback("spoon", "ooooo") == "XXGGX"
    assert feedback("lemon", "melon") == "YGYGG"
    assert parse_guess("I think [Crane] fits") == "crane" and parse_guess("crane") is None
    assert game_reward("crane", ["[trace]", "[crane]"]) == 1.0
    assert game_reward("crane", ["[crate]"]) == pytest.approx(0.5 * 4 / 5)
    assert game_reward("crane", ["no guess here"]) == 0.0
    assert turn_message("crane", "trace", 4) == "TRACE -> X G G Y G. 4 guesses left."
    assert turn_message("crane", None, 3).startswith("Invalid guess")


def test_math_answers_are_verified_not_string_matched() -> None:
    from math_sanity import answer_is_correct

    rows = [json.loads(line) for line in resources.files("math_sanity").joinpath("data/problems.jsonl").open()]
    assert len(rows) >= 50
    assert all(answer_is_correct(f"Therefore \\boxed{{{row['answer']}}}.", row["answer"]) for row in rows)
    assert answer_is_correct("\\boxed{15/2}", "7.5")
    assert answer_is_correct("\\boxed{0.375}", "\\frac{3}{8}")
    assert not answer_is_correct("\\boxed{8}", "7.5")
    assert not answer_is_correct("I do not know", "21")


def test_wiki_search_tools_find_the_answers() -> None:
    from wiki_search import TOOLS, WikiSearchHarness, answer_matches, read_article, search_wiki

    assert search_wiki("lighthouse Halvik first lit").startswith("Grey Lantern:")
    assert "1611" in read_article("grey lantern")
    assert read_article("Atlantis").startswith("No article titled")
    assert answer_matches("It is on Kettlemoor.\nAnswer: the Halvik", "Halvik", [])
    assert answer_matches("Answer: 1,208 metres", "1208 metres", [])
    assert not answer_matches("Answer: Brannock", "Halvik", [])
    harness = vf.load_harness(vf.default_agent_harness("wiki-search"))
    assert isinstance(harness, WikiSearchHarness) and harness.tools() == TOOLS


def test_every_question_is_answerable_from_the_corpus() -> None:
    from wiki_search import corpus

    text = " ".join(article.text for article in corpus().articles.values())
    for task in load_env("wiki-search").taskset:
        assert task.data.answer.lower() in text.lower().replace(",", "") or any(
            alias.lower() in text.lower() for alias in task.data.aliases
        ), task.data.prompt


def test_tool_calls_with_bad_arguments_answer_with_an_error() -> None:
    tool = Tool("echo", "echo", {"type": "object"}, fn=lambda text: text.upper())
    call = lambda arguments: asyncio.run(tool.call(arguments))
    assert call('{"text": "hi"}') == "HI"
    assert call("{not json").startswith("error: the arguments are not valid JSON")
    assert call("[1]") == "error: the arguments must be a JSON object"
    assert call('{"wrong": 1}').startswith("error:")
