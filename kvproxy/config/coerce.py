"""YAML values to the types a section's fields are annotated with. Pure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvproxy.config.errors import ConfigError


def as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key}: must be true or false (got {value!r})")


def as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be an integer (got {value!r})")
    return value


def as_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: must be a number (got {value!r})")
    return float(value)


def as_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: must be a string (got {value!r})")
    return value


def as_str_tuple(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ConfigError(f"{key}: must be a list (got {value!r})")
    if not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: must be a list of strings (got {value!r})")
    return tuple(value)


# Field annotation (without ``| None``) -> the coercion of a YAML value to it.
_COERCIONS: dict[str, Callable[[str, Any], Any]] = {
    "bool": as_bool,
    "int": as_int,
    "float": as_float,
    "str": as_str,
}


def coerce(key: str, value: Any, annotation: str) -> Any:
    """Coerce a YAML scalar to the field's annotated type, or raise ConfigError."""
    if value is None:
        if "None" in annotation:
            return None
        raise ConfigError(f"{key}: must be set (got null)")
    base = annotation.replace(" | None", "").strip()
    convert = _COERCIONS.get(base)
    if convert is None and base.startswith("tuple"):
        convert = as_str_tuple
    if convert is None:
        raise AssertionError(f"unhandled annotation {annotation} for {key}")
    return convert(key, value)
