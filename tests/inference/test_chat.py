"""Text handling around the engine: incremental decoding with stop strings, and Hermes-style tool-call parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primerl.inference.chat import CompletionText, cut_at_stop, split_tool_calls


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream(tokenizer, text: str, stop: list[str], hold_tool_calls: bool = False) -> tuple[list[str], str]:
    pieces = CompletionText(tokenizer, stop, hold_tool_calls)
    ids = tokenizer.encode(text, add_special_tokens=False)
    released = [pieces.push(i) for i in ids]
    return released, pieces.finish()


TEXTS = ["plain ascii words", "naïve café — 東京 🚀 mixed bytes", "a stop word inside, then more", "  spaces  "]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_decoded_text(tokenizer, text: str):
    released, rest = stream(tokenizer, text, stop=[])
    assert "".join(released) + rest == text
    assert all("\ufffd" not in piece for piece in released)


@pytest.mark.parametrize("stop", [["stop"], ["zzz", "inside"], ["a"]])
def test_stop_string_is_cut_and_never_released(tokenizer, stop: list[str]):
    text = TEXTS[2]
    released, rest = stream(tokenizer, text, stop)
    assert "".join(released) + rest == cut_at_stop(text, stop)
    assert not any(s in "".join(released) for s in stop)


def test_possible_stop_prefix_is_held_back(tokenizer):
    pieces = CompletionText(tokenizer, ["stopword"])
    out = "".join(pieces.push(i) for i in tokenizer.encode("go sto", add_special_tokens=False))
    assert out == "go "  # "sto" may still become "stopword"
    assert pieces.finish() == "sto"


def test_tool_call_text_is_held_until_the_end(tokenizer):
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    released, rest = stream(tokenizer, "Let me look. " + call, stop=[], hold_tool_calls=True)
    assert "".join(released) == "Let me look. "
    assert rest == call


def test_split_tool_calls_parses_hermes_blocks():
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>{"name": "noop"}</tool_call>'
    content, calls = split_tool_calls(text)
    assert content == "Sure."
    assert [c.function.name for c in calls] == ["add", "noop"]
    assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
    assert json.loads(calls[1].function.arguments) == {}
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    ["no calls here", "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{"],
)
def test_text_without_well_formed_calls_stays_content(text: str):
    assert split_tool_calls(text) == (text, [])


def test_only_tool_calls_leave_no_content():
    content, calls = split_tool_calls('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')
    assert content is None
    assert calls[0].function.arguments == "{}"
