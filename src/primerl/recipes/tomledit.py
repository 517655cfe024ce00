"""Rewrite some tables of a TOML file in place, keeping every comment, blank line and other table as it was.

Only what `primerl recipe lock` needs: tables whose entries are one `key = "string"` per line. A value is replaced on
its own line (its trailing comment stays), a key that is no longer wanted loses its line, a new key goes after the
table's last entry, a new table after the last edited table of its family (its parent and the parent's other subtables). The result is parsed back and compared with what was
asked for, so an edit that the file's layout defeats fails loudly instead of writing a wrong file.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping

_HEADER = re.compile(r"^\s*\[(?P<double>\[)?\s*(?P<name>[^\[\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = r'(?P<key>[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*")'
_VALUE = r'(?P<value>"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_ENTRY = re.compile(rf"^(?P<indent>\s*){_KEY}(?P<eq>\s*=\s*){_VALUE}(?P<rest>\s*(?:#.*)?)$")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class TomlEditError(Exception):
    """The file's layout does not allow an in-place edit; the message says where."""


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def toml_string(value: str) -> str:
    return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes


def _entry_key(match: re.Match) -> str:
    key = match["key"]
    return json.loads(key) if key.startswith('"') else key


def replace_tables(text: str, tables: Mapping[str, Mapping[str, str]]) -> str:
    """`text` with each table named in `tables` holding exactly the given string entries, in place."""
    lines = text.splitlines()
    sections: list[tuple[str | None, int, int]] = []  # (table name, first line, end line exclusive)
    start, name = 0, None
    for i, line in enumerate(lines):
        header = _HEADER.match(line)
        if header:
            sections.append((name, start, i))
            start, name = i, None if header["double"] else header["name"].replace(" ", "")
    sections.append((name, start, len(lines)))

    out: list[str] = []
    ends: dict[str, int] = {}  # edited table -> index in `out` just after its last entry (or its header)
    for name, first, end in sections:
        if name not in tables:
            out.extend(lines[first:end])
            continue
        out.extend(_edit_table(name, lines[first:end], tables[name]))
        at = len(out)
        while not _ENTRY.match(out[at - 1]) and not _HEADER.match(out[at - 1]):
            at -= 1
        ends[name] = at
    blocks: dict[int, list[str]] = {}
    for name in (n for n in tables if n not in ends and tables[n]):
        parent = name.rpartition(".")[0]
        family = [ends[e] for e in ends if e == parent or e.startswith(parent + ".")] if parent else []
        at = max(family or ends.values(), default=len(out))
        blocks.setdefault(at, []).extend(
            ["", f"[{name}]", *(f"{toml_key(k)} = {toml_string(v)}" for k, v in tables[name].items())]
        )
    for at in sorted(blocks, reverse=True):
        out[at:at] = blocks[at]
    result = "\n".join(out) + ("\n" if text.endswith("\n") or not text else "")
    _check(result, tables)
    return result


def _edit_table(name: str, lines: list[str], wanted: Mapping[str, str]) -> list[str]:
    out, done, last_entry = [lines[0]], set(), 0
    for line in lines[1:]:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            out.append(line)
            continue
        entry = _ENTRY.match(line)
        if entry is None:
            raise TomlEditError(f"[{name}]: cannot edit {line.strip()!r} in place (want one key = \"string\" a line)")
        key = _entry_key(entry)
        if key not in wanted:
            continue
        out.append(f"{entry['indent']}{entry['key']}{entry['eq']}{toml_string(wanted[key])}{entry['rest']}")
        done.add(key)
        last_entry = len(out)
    missing = [f"{toml_key(k)} = {toml_string(v)}" for k, v in wanted.items() if k not in done]
    at = last_entry or 1
    out[at:at] = missing
    return out


def _check(result: str, tables: Mapping[str, Mapping[str, str]]) -> None:
    try:
        parsed = tomllib.loads(result)
    except tomllib.TOMLDecodeError as e:
        raise TomlEditError(f"the edited file would not parse: {e}") from None
    for name, wanted in tables.items():
        node = parsed
        for part in name.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        got = {k: v for k, v in node.items() if not isinstance(v, dict)}
        if got != dict(wanted):
            raise TomlEditError(f"[{name}] would read back as {got}, not {dict(wanted)}")
