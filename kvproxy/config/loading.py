"""Building a :class:`~kvproxy.config.model.Config` from YAML.

Pure apart from :func:`load_config`, which reads the file. Every error names the
offending key (with the closest valid one when a key is unknown).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from kvproxy.config.admission import resolve_session_residency
from kvproxy.config.coerce import coerce
from kvproxy.config.errors import ConfigError
from kvproxy.config.model import SECTIONS, Config, validate
from kvproxy.yamlload import DuplicateKeyError, load_yaml

# Section -> what turns its old (renamed) keys into current ones: the mapping left to
# read as usual, and the changes the old keys imply.
_OLD_KEYS: dict[str, Callable[[Mapping[str, Any]], tuple[Mapping[str, Any], dict[str, Any]]]] = {
    "admission": resolve_session_residency,
}


def _did_you_mean(key: str, valid: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean admission.headroom?"`` for the closest valid key, or ``""``."""
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{match[0]}?" if match else ""


def _build_section(name: str, raw: Any, base: Any) -> Any:
    cls = SECTIONS[name]
    if raw is None:
        return base
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{name}: must be a mapping (got {type(raw).__name__})")
    known = {f.name: f for f in fields(cls)}
    changes: dict[str, Any] = {}
    old_keys = _OLD_KEYS.get(name)
    if old_keys is not None:
        raw, changes = old_keys(raw)
    for key, value in raw.items():
        if key not in known:
            allowed = ", ".join(sorted(known))
            hint = _did_you_mean(str(key), known, prefix=f"{name}.")
            raise ConfigError(f"{name}.{key}: unknown key{hint} (allowed: {allowed})")
        changes[key] = coerce(f"{name}.{key}", value, str(known[key].type))
    return dataclasses.replace(base, **changes)


def from_mapping(raw: Mapping[str, Any] | None, source: str | None = None) -> Config:
    """Build and validate a Config from a parsed YAML document."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ConfigError("top level: must be a mapping of sections")
    for key in raw:
        if key not in SECTIONS:
            hint = _did_you_mean(str(key), SECTIONS)
            raise ConfigError(f"{key}: unknown section{hint} (allowed: {', '.join(SECTIONS)})")
    defaults = Config()
    cfg = Config(
        **{name: _build_section(name, raw.get(name), getattr(defaults, name)) for name in SECTIONS},
        source=source,
    )
    validate(cfg)
    return cfg


def load_config(path: str | Path | None) -> Config:
    """Read and validate the YAML file at ``path`` (defaults when ``path`` is None)."""
    if path is None:
        return from_mapping({})
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror or exc}") from exc
    try:
        raw = load_yaml(text)
    except DuplicateKeyError as exc:
        raise ConfigError(f"{p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from exc
    return from_mapping(raw, source=str(p))
