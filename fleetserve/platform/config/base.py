"""What every config section shares: strict keys, the error type, and the name pattern."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, field_validator

# Model names become Serve deployment names (``serve_safe``) and URL-visible ids. Parts joined by '/' take
# Hugging Face's ids as they are (``Qwen/Qwen2.5-7B-Instruct``), so clients of `vllm serve` keep their names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*(/[A-Za-z0-9][A-Za-z0-9._\-]*)*$")
MAX_NAME_CHARS = 128


def check_name(name: str) -> str:
    """A model or adapter name, as clients send it: 1-128 letters, digits, '.', '_' or '-', in parts joined by
    '/' (a Hugging Face id), each starting alphanumeric.

    Raises:
        ValueError: any other name.
    """
    if len(name) > MAX_NAME_CHARS or not NAME_PATTERN.match(name):
        raise ValueError(f"expected 1-{MAX_NAME_CHARS} characters of letters, digits, '.', '_' or '-' (parts "
                         f"joined by '/', as in org/name), each part starting alphanumeric")
    return name


def serve_safe(name: str) -> str:
    """``name`` as part of a Serve deployment name: '/' becomes '--', as Ray Serve LLM writes model ids."""
    return name.replace("/", "--")


# A model or adapter name field.
ModelName = Annotated[str, AfterValidator(check_name)]
MiB = 1024 * 1024


class ConfigError(ValueError):
    """A platform config that cannot be served; the message names each bad key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class WithExtra(Strict):
    """A section with typed keys plus ``extra`` for the rest; a key may not be given in both places."""

    # The section's name in error messages.
    _section: ClassVar[str] = ""

    @field_validator("extra", check_fields=False)
    @classmethod
    def _extra_is_not_typed(cls, extra: dict[str, Any]) -> dict[str, Any]:
        overlap = sorted(set(extra) & (set(cls.model_fields) - {"extra"}))
        if overlap:
            raise ValueError(f"repeats typed keys {overlap}; set them directly under {cls._section}")
        return extra


def format_errors(error: ValidationError, what: str) -> str:
    """One line per problem, each naming its key path (``models.0.engine_args.dtype: unknown key``)."""
    lines = [f"invalid {what}:"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif item["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            got = item.get("input")
            shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
            lines.append(f"  {key}: {item['msg']}{shown}")
    return "\n".join(lines)


SectionT = TypeVar("SectionT", bound=BaseModel)


def parse_section(section: type[SectionT], data: Any, origin: str, what: str | None = None,
                  expected: str = "a mapping") -> SectionT:
    """Validates one config section on its own (an ``autoscaling:`` block read by the simulator), or a
    whole config.

    Args:
        what: how errors name the section; its class name by default.
        expected: what a non-mapping should have been, for the error.

    Raises:
        ConfigError: naming every offending key.
    """
    label = f"{what or section.__name__} ({origin})"
    if not isinstance(data, dict):
        raise ConfigError(f"invalid {label}: expected {expected}")
    try:
        return section.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_errors(error, label)) from None
