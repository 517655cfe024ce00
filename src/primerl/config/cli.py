"""Command-line glue shared by every process: `--help` generated from the config model, `--dry-run`, and one-line
config errors with exit code 2."""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

import pydantic

from primerl.config.loader import ConfigError, load, table_types, to_toml, union_tag

M = TypeVar("M", bound=pydantic.BaseModel)


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(ann))
        return f"{getattr(origin, '__name__', origin)}[{args}]"
    return getattr(ann, "__name__", str(ann))


def field_help(model: type[pydantic.BaseModel], prefix: str = "") -> list[str]:
    """One line per leaf option: `--a.b  TYPE  (default X)  description`; a table chosen by `type` lists each
    choice's options under a line naming it."""
    lines = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        tables = table_types(ann)
        if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
            if info.description:
                lines.append(f"  [{prefix}{name}]  {info.description}")
            lines.extend(field_help(ann, f"{prefix}{name}."))
            continue
        if len(tables) > 1 and all(union_tag(t) for t in tables):
            default = info.get_default(call_default_factory=True)
            lines.append(f"  [{prefix}{name}]  {info.description or ''}  (default type {union_tag(type(default))!r})")
            for table in tables:
                lines.append(f"    type = {union_tag(table)}: {(table.__doc__ or '').strip().splitlines()[0]}")
                lines.extend(line for line in field_help(table, f"{prefix}{name}.")
                             if not line.startswith(f"  --{prefix}{name}.type "))
            continue
        default = "required" if info.is_required() else f"default {info.get_default(call_default_factory=True)!r}"
        desc = f"  {info.description}" if info.description else ""
        lines.append(f"  --{prefix}{name}  {_type_name(ann)}  ({default}){desc}")
    return lines


def usage(prog: str, model: type[pydantic.BaseModel], summary: str) -> str:
    return "\n".join(
        [
            f"usage: {prog} [@ config.toml ...] [--key.sub value | --key.sub=value | --flag | --no-flag] [--dry-run]",
            "",
            summary,
            "",
            "Config files merge left to right (tables deep-merge, lists replace); PRIMERL_A__B=value environment",
            "variables override files; command-line options override both. --dry-run prints the resolved config.",
            "",
            "options:",
            *field_help(model),
        ]
    )


def config_from_argv(model: type[M], argv: Sequence[str] | None, prog: str, summary: str = "") -> M:
    """Resolve `model` from argv, or exit: 0 after --help or --dry-run, 2 with one line on a config error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(usage(prog, model, summary or (model.__doc__ or "").strip()))
        raise SystemExit(0)
    try:
        cfg, parsed = load(model, argv)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        raise SystemExit(ConfigError.exit_code) from None
    if parsed.dry_run:
        print(to_toml(cfg), end="")
        raise SystemExit(0)
    return cfg
