"""Resolve a typed config from TOML files, `@ file.toml` includes, environment variables and CLI overrides.

Layers, lowest priority first: field defaults < TOML files (left to right) < `PRIMERL_*` environment variables <
command-line overrides. Tables deep-merge; every other value (lists included) replaces what was there.

A TOML file may pull in others with a top-level `include = ["base.toml", ...]` (paths relative to the file); the
included files are merged first, then the file itself on top.

Nothing here imports torch: the loader runs in every process, including ones that never touch a model.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import tomli_w

ENV_PREFIX = "PRIMERL_"
ENV_NESTED = "__"
INCLUDE_KEY = "include"

M = TypeVar("M", bound=pydantic.BaseModel)

# The merged TOML files of the `load` call in progress, read by ProcessConfig's settings source.
FILE_LAYER: ContextVar[dict[str, Any] | None] = ContextVar("primerl_file_layer", default=None)


class ConfigError(Exception):
    """One problem with the user's configuration; the message is a single line naming the key or file."""

    exit_code = 2


@dataclass
class Layers:
    """The merged raw values plus, for each dotted key, where its value came from (for error messages)."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)

    def merge(self, data: Mapping[str, Any], source: str, prefix: str = "") -> None:
        _deep_merge(self.values, data, self.origin, source, prefix)


def _deep_merge(dst: dict, src: Mapping, origin: dict, source: str, prefix: str) -> None:
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value, origin, source, dotted + ".")
        else:
            dst[key] = _plain(value)
            for stale in [k for k in origin if k.startswith(dotted + ".")]:
                del origin[stale]
            origin[dotted] = source
            if isinstance(value, Mapping):
                _record_origin(value, origin, source, dotted + ".")


def _record_origin(src: Mapping, origin: dict, source: str, prefix: str) -> None:
    for key, value in src.items():
        origin[f"{prefix}{key}"] = source
        if isinstance(value, Mapping):
            _record_origin(value, origin, source, f"{prefix}{key}.")


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------------------------------------
# TOML files


def read_toml(path: str | os.PathLike, _stack: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read one TOML file with its `include` chain resolved (includes first, the file on top)."""
    p = Path(path).expanduser()
    if not p.is_file():
        where = f" (included from {_stack[-1]})" if _stack else ""
        raise ConfigError(f"config file not found: {path}{where}")
    p = p.resolve()
    if p in _stack:
        raise ConfigError(f"include cycle: {' -> '.join(str(s) for s in (*_stack, p))}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    includes = data.pop(INCLUDE_KEY, [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{path}: '{INCLUDE_KEY}' must be a path or a list of paths")
    merged: dict[str, Any] = {}
    for inc in includes:
        _deep_merge(merged, read_toml(p.parent / inc, (*_stack, p)), {}, "", "")
    _deep_merge(merged, data, {}, "", "")
    return merged


# ---------------------------------------------------------------------------------------------------------------------
# Command line


@dataclass
class ParsedArgs:
    files: list[str] = field(default_factory=list)
    overrides: list[tuple[str, Any]] = field(default_factory=list)
    dry_run: bool = False


def _cli_value(raw: str) -> Any:
    """Lists and tables come as JSON (`--a.b '[1, 2]'`); everything else stays a string for pydantic to coerce."""
    if raw[:1] in "[{":
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ConfigError(f"cannot parse {raw!r} as a JSON list/table") from None
    return raw


def _key(flag: str) -> str:
    return flag.replace("-", "_")


def parse_args(argv: Sequence[str], flag_names: set[str] | None = None) -> ParsedArgs:
    """Split argv into config files and dotted overrides.

    Accepted forms: `@ a.toml`, `@a.toml`, `a.toml` (a bare path ending in .toml), `--a.b value`, `--a.b=value`,
    `--flag` (true when no value follows), `--no-flag` (false), `--dry-run`.
    `flag_names` lists the dotted keys that are booleans, so `--flag` never swallows the next token.
    """
    out = ParsedArgs()
    flag_names = flag_names or set()
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "@":
            if i + 1 >= len(args):
                raise ConfigError("'@' must be followed by a config file")
            out.files.append(args[i + 1])
            i += 2
            continue
        if arg.startswith("@"):
            out.files.append(arg[1:])
        elif arg == "--dry-run":
            out.dry_run = True
        elif arg.startswith("--") and len(arg) > 2:
            body = arg[2:]
            if "=" in body:
                name, raw = body.split("=", 1)
                out.overrides.append((_key(name), _cli_value(raw)))
            else:
                name = _key(body)
                nxt = args[i + 1] if i + 1 < len(args) else None
                negated = _negated(name)
                if negated in flag_names:
                    out.overrides.append((negated, False))
                elif name in flag_names or nxt is None or nxt.startswith(("--", "@")):
                    out.overrides.append((name, True))
                else:
                    out.overrides.append((name, _cli_value(nxt)))
                    i += 1
        elif arg.endswith(".toml"):
            out.files.append(arg)
        else:
            raise ConfigError(f"unexpected argument {arg!r} (config files end in .toml; overrides look like --a.b=value)")
        i += 1
    return out


def _negated(name: str) -> str:
    """`--no-x.y` and `--x.no-y` both name the flag x.y."""
    if name.startswith("no_"):
        return name[3:]
    head, _, last = name.rpartition(".")
    return f"{head}.{last[3:]}" if last.startswith("no_") else ""


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = value
    for part in reversed(dotted.split(".")):
        if not part:
            raise ConfigError(f"bad override key {dotted!r}")
        out = {part: out}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Environment


def env_overrides(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """`PRIMERL_TRAINER__OPTIM__LR=1e-5` -> ("trainer.optim.lr", "1e-5", "PRIMERL_TRAINER__OPTIM__LR")."""
    environ = os.environ if environ is None else environ
    out = []
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            dotted = ".".join(p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_NESTED))
            out.append((dotted, value, name))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Resolution


def bool_fields(model: type[pydantic.BaseModel], prefix: str = "") -> set[str]:
    """Dotted names of all boolean fields, so `--flag` needs no value."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        if info.annotation is bool:
            out.add(prefix + name)
        for table in table_types(info.annotation):
            out |= bool_fields(table, f"{prefix}{name}.")
    return out


def known_top_level(model: type[pydantic.BaseModel]) -> set[str]:
    return set(model.model_fields)


def build_layers(
    model: type[pydantic.BaseModel],
    files: Sequence[str] = (),
    overrides: Sequence[tuple[str, Any]] = (),
    environ: Mapping[str, str] | None = None,
    base: Mapping[str, Any] | Layers | None = None,
) -> Layers:
    """The layers of a config with each dotted key's source: `base` (a `Layers` keeps the sources it names; plain
    values are named as the caller's base values), the files, `PRIMERL_*` variables, then the command line."""
    layers = Layers()
    _merge_base(layers, base)
    for f in files:
        layers.merge(read_toml(f), str(f))
    top = known_top_level(model)
    for dotted, value, var in env_overrides(environ):
        # Only variables that name a field of this config: PRIMERL_ADMIN_TOKEN and friends stay with their owners.
        if dotted.split(".")[0] in top:
            layers.merge(_nest(dotted, value), f"${var}")
    for dotted, value in overrides:
        layers.merge(_nest(dotted, value), f"--{dotted}")
    return layers


def _merge_base(layers: Layers, base: Mapping[str, Any] | Layers | None) -> None:
    if isinstance(base, Layers):
        layers.merge(base.values, "base values")
        layers.origin.update(base.origin)
    elif base:
        layers.merge(base, "base values")


def table_types(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """The config tables a field holds: one (`Section`, `Section | None`), several (a union of sections selected by
    their `type`), or none (any other value, lists of tables included)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    out: list[type[pydantic.BaseModel]] = []
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        for member in typing.get_args(annotation):
            out += [table for table in table_types(member) if table not in out]
    return out


def union_tag(table: type[pydantic.BaseModel]) -> str | None:
    """The `type` that selects `table` in a union of tables (its `type` field's default), else None."""
    info = table.model_fields.get("type")
    return info.default if info is not None and isinstance(info.default, str) else None


def _free_form(annotation: Any) -> bool:
    """A field whose value is a table of any keys (`dict[str, Any]`, possibly `| None`)."""
    return any(a is dict or typing.get_origin(a) is dict for a in (annotation, *typing.get_args(annotation)))


def option_names(model: type[pydantic.BaseModel], prefix: str = "") -> list[str]:
    """Every leaf option of a config, dotted (`trainer.optim.lr`)."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        tables = table_types(info.annotation)
        for option in [o for t in tables for o in option_names(t, f"{prefix}{name}.")] or [prefix + name]:
            if option not in out:
                out.append(option)
    return out


def is_option(model: type[pydantic.BaseModel], dotted: str) -> bool:
    """Whether `dotted` names an option or a table of `model`, or a key inside one of its free-form tables."""
    head, _, rest = dotted.partition(".")
    info = model.model_fields.get(head)
    if info is None:
        return model.model_config.get("extra") == "allow"
    tables = table_types(info.annotation)
    if not tables:
        return not rest or _free_form(info.annotation)
    return not rest or any(is_option(table, rest) for table in tables)


def closest_option(model: type[pydantic.BaseModel], dotted: str) -> str | None:
    """The option of `model` whose name is closest to a mistyped `dotted`, when one is close."""
    found = difflib.get_close_matches(dotted, option_names(model), n=1, cutoff=0.6)
    return found[0] if found else None


def validate(model: type[M], layers: Layers) -> M:
    try:
        return model.model_validate(layers.values)
    except pydantic.ValidationError as e:
        raise ConfigError(describe_validation_error(e, layers, model)) from None


def describe_validation_error(e: pydantic.ValidationError, layers: Layers,
                              model: type[pydantic.BaseModel] | None = None) -> str:
    """One line per problem, each naming the dotted key and where its value came from (and, for an unknown key of
    `model`, the option it is closest to)."""
    lines = []
    for err in e.errors():
        loc, tags = _without_union_tags(model, list(err["loc"])) if model is not None else (err["loc"], [])
        key = ".".join(str(p) for p in loc)
        src = _source_for(key, layers.origin)
        where = f" (from {src})" if src else ""
        where += "".join(f" (type = {tag!r})" for tag in tags)
        if err["type"] == "extra_forbidden":
            close = closest_option(model, key) if model is not None else None
            hint = f"; did you mean '{close}'?" if close and close != key else ""
            if close == key:
                hint = f"; it is an option of another type than {tags[-1]!r}" if tags else ""
            lines.append(f"unknown key '{key}'{where}{hint}")
        elif err["type"] == "missing":
            lines.append(f"missing required key '{key}'")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f", got {got!r}"
            lines.append(f"'{key}': {err['msg']}{shown}{where}")
    return "; ".join(lines)


def _without_union_tags(model: type[pydantic.BaseModel], loc: list[Any]) -> tuple[list[Any], list[str]]:
    """pydantic names the member of a union of tables in an error's location (`loss.gspo.clip_low`): the location
    as the user wrote it (`loss.clip_low`), and the members named."""
    out: list[Any] = []
    tags: list[str] = []
    node: type[pydantic.BaseModel] | None = model
    rest = list(loc)
    while rest:
        part = rest.pop(0)
        out.append(part)
        info = node.model_fields.get(part) if node is not None and isinstance(part, str) else None
        if info is None:
            node = None
            continue
        tables = table_types(info.annotation)
        if not tables and typing.get_origin(info.annotation) is list and rest and isinstance(rest[0], int):
            out.append(rest.pop(0))
            tables = table_types(typing.get_args(info.annotation)[0])
        by_tag = {union_tag(t): t for t in tables} if len(tables) > 1 else {}
        if rest and rest[0] in by_tag:
            tags.append(rest[0])
            node = by_tag[rest.pop(0)]
        else:
            node = tables[0] if len(tables) == 1 else None
    return out, tags


def _source_for(key: str, origin: Mapping[str, str]) -> str | None:
    parts = key.split(".")
    while parts:
        src = origin.get(".".join(parts))
        if src:
            return src
        parts.pop()
    return None


def load(model: type[M], argv: Sequence[str] = (), base: Mapping[str, Any] | Layers | None = None,
         ) -> tuple[M, ParsedArgs]:
    """Parse argv, merge all layers and validate into `model`. Raises ConfigError with a one-line message.

    For pydantic-settings models the layering is done by pydantic-settings itself: command-line values are the init
    arguments, then its environment source, then the TOML files (see `ProcessConfig.settings_customise_sources`).
    `Layers` is still built in full so every error can say where the offending value came from.
    """
    from pydantic_settings import BaseSettings

    parsed = parse_args(argv, bool_fields(model))
    layers = build_layers(model, parsed.files, parsed.overrides, base=base)
    if not issubclass(model, BaseSettings):
        return validate(model, layers), parsed
    files = Layers()
    _merge_base(files, base)
    for f in parsed.files:
        files.merge(read_toml(f), str(f))
    cli = Layers()
    for dotted, value in parsed.overrides:
        cli.merge(_nest(dotted, value), f"--{dotted}")
    token = FILE_LAYER.set(files.values)
    try:
        return model(**cli.values), parsed
    except pydantic.ValidationError as e:
        raise ConfigError(describe_validation_error(e, layers, model)) from None
    finally:
        FILE_LAYER.reset(token)


def to_toml(cfg: pydantic.BaseModel) -> str:
    """The resolved config as TOML (None values are left out: TOML has no null)."""
    return tomli_w.dumps(_drop_none(cfg.model_dump(mode="json")))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value if v is not None]
    return value
