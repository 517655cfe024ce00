"""Command-line glue shared by every process: `--help` generated from the config model, `--dry-run`, and one-line
config errors with exit code 2."""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

import pydantic

from primerl.config.loader import ConfigError, load, to_toml

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
    """One line per leaf option: `--a.b  TYPE  (default X)  description`."""
    lines = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
            if info.description:
                lines.append(f"  [{prefix}{name}]  {info.description}")
            lines.extend(field_help(ann, f"{prefix}{name}."))
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
