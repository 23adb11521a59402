"""The configuration's error and the one check every section validator uses. Pure."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


def check(cond: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``cond``."""
    if not cond:
        raise ConfigError(message)


def check_each(
    section: str, obj: Any, keys: Iterable[str], ok: Callable[[Any], bool], rule: str
) -> None:
    """``section.key: <rule> (got value)`` for the first of ``keys`` whose value fails ``ok``."""
    for key in keys:
        value = getattr(obj, key)
        check(ok(value), f"{section}.{key}: {rule} (got {value})")
