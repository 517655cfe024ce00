"""Every command line in README.md and docs/*.md works as pasted into a fresh checkout.

The command lines are those of the code blocks (fenced blocks other than toml/json/python, and indented blocks): each
must start with `uv run` (a bare `rl`, `sft`, `primerl` or `python` is not on the PATH of a fresh clone), and each
`uv run` command is run here without `uv run` (the test already runs in the project's environment): the cheap ones as
written (`--help`, a `python -c` snippet, in a scratch directory), the heavy ones (`rl`, `sft`, `eval`, the processes,
`primerl run`) with `--dry-run` appended, which resolves and validates the whole config and runs nothing, and the
tools whose work needs a run or a daemon (`plot`, `check`, `recipe`, `image`, `launch`) as `<tool> [<sub>] --help`, so
that at least the command exists. `docker ...` lines (they run inside an image) are not run here.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BARE_PROGRAMS = {"rl", "sft", "eval", "primerl", "python", "pytest", "inference", "trainer", "orchestrator"}
DRY_RUN = {"rl", "sft", "eval", "inference", "trainer", "orchestrator", "run"}
NOT_CODE = {"toml", "json", "python", "text"}


def command_lines(path: Path) -> list[str]:
    """The shell command lines of a markdown file's code blocks (continuations joined, comments dropped)."""
    out: list[str] = []
    lines = path.read_text().splitlines()
    fence: str | None = None
    pending = ""
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:].strip()
            continue
        in_code = (fence is not None and fence not in NOT_CODE) or (
            fence is None and line.startswith("    ") and (i == 0 or not lines[i - 1].strip() or
                                                          lines[i - 1].startswith("    ")))
        if not in_code:
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        words = text.split()
        if words and (words[0] in BARE_PROGRAMS or words[:2] == ["uv", "run"]) and not re.match(r"^\w+ [─-]", text):
            out.append(text)
    return out


COMMANDS = [(path.relative_to(ROOT).as_posix(), line) for path in DOCS for line in command_lines(path)]


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) >= 30
    assert {path for path, _ in COMMANDS} >= {"README.md", "docs/rl.md", "docs/recipes.md", "docs/demo.md"}


@pytest.mark.parametrize(("doc", "line"), COMMANDS, ids=[f"{d}:{line[:50]}" for d, line in COMMANDS])
def test_every_docs_command_is_written_with_uv_run(doc, line):
    assert line.startswith("uv run "), f"{doc}: '{line}' fails in a fresh clone; write 'uv run {line}'"


def check_command(words: list[str]) -> tuple[list[str], bool]:
    """The command line to run for a documented `uv run` command (without `uv run`), and whether it runs in a scratch
    directory (it writes files)."""
    words = [w for w in words if w != "..."]  # "the other options", in a synopsis
    program, args = words[0], words[1:]
    python = [sys.executable]
    if program == "pytest":
        return [*python, "-m", "pytest", "--version"], False
    if program == "python":
        if args[:1] == ["-c"]:
            return [*python, *args], True
        if args[:1] == ["-m"]:
            return [*python, "-m", args[1], "--help"], False
        return [*python, args[0], "--help"], False
    if program == "primerl":
        program, args = args[0], args[1:]
    base = [*python, "-m", "primerl.cli", program]
    if program in DRY_RUN:
        return [*base, *args] if "--help" in args else [*base, *args, "--dry-run"], False
    sub = [a for a in args[:1] if not a.startswith("-") and "/" not in a and not a.endswith(".toml")]
    return [*base, *sub, "--help"], False


@pytest.mark.parametrize(("doc", "line"), COMMANDS, ids=[f"{d}:{line[:50]}" for d, line in COMMANDS])
def test_every_docs_command_runs_or_parses(doc, line, tmp_path):
    words = shlex.split(line, comments=True)
    if words[:2] != ["uv", "run"]:
        pytest.fail(f"{doc}: '{line}' does not start with 'uv run'")
    argv, scratch = check_command(words[2:])
    proc = subprocess.run(argv, cwd=tmp_path if scratch else ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, f"{doc}: '{line}' -> {' '.join(argv[1:])}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
