"""Base classes of every primerl config: sections forbid unknown keys; process configs are pydantic-settings models."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from primerl.config.loader import ENV_NESTED, ENV_PREFIX, FILE_LAYER


def require_known(names: Sequence[str], known: Collection[str], what: str, listing: str) -> None:
    """Raise `ValueError` naming every one of `names` not in `known` (`unknown <what> [...]; <listing>: a, b`)."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; {listing}: {', '.join(known)}")


def known_names(known: Collection[str], what: str, listing: str) -> AfterValidator:
    """A field's validator (`Annotated[list[str], known_names(...)]`): each name is one of `known` (`require_known`)."""

    def check(names: list[str]) -> list[str]:
        require_known(names, known, what, listing)
        return names

    return AfterValidator(check)


class Section(BaseModel):
    """A table of a config file. Unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class _FileSource(PydanticBaseSettingsSource):
    """The TOML files of the current `load` call, already merged (includes and `@` files, left to right)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (FILE_LAYER.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(FILE_LAYER.get() or {})


class ProcessConfig(BaseSettings):
    """The top-level config of one process. Priority: command line > PRIMERL_* environment > TOML files > defaults."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED,
        extra="forbid",
        validate_assignment=True,
        protected_namespaces=(),
        nested_model_default_partial_update=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _FileSource(settings_cls)
