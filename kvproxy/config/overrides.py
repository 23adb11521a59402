"""CLI flags that override YAML keys (the last step of defaults < YAML < CLI). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvproxy.config.errors import ConfigError
from kvproxy.config.model import Config, validate

# CLI flag -> (section, key). Relax-compatible names first.
CLI_OVERRIDES: dict[str, tuple[str, str]] = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "router_url": ("router", "url"),
    "agentic_session_lifecycle": ("session_lifecycle", "enabled"),
    "agentic_program_admission": ("admission", "enabled"),
    "agentic_admission_headroom": ("admission", "headroom"),
    "agentic_admission_pressure_threshold": ("admission", "pressure_threshold"),
    "agentic_admission_expected_decode_cap": ("admission", "expected_decode_cap"),
    "agentic_admission_max_wait_s": ("admission", "max_wait_s"),
    "agentic_admission_scope": ("admission", "scope"),
    "admission_mode": ("admission", "mode"),
    "router_policy": ("router", "policy"),
    "time_scale": ("server", "time_scale"),
    "token_scale": ("server", "token_scale"),
}


def flag_name(override: str) -> str:
    """``"agentic_admission_max_wait_s"`` -> ``"--agentic-admission-max-wait-s"``."""
    return "--" + override.replace("_", "-")


def apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """Apply CLI overrides (None values are "not given") and re-validate.

    An error about a value a flag set names the flag (and the key it sets).
    """
    given: dict[str, str] = {}
    for name, value in overrides.items():
        if value is None:
            continue
        section, key = CLI_OVERRIDES[name]
        given[f"{section}.{key}"] = name
        cfg = cfg.replace(section, **{key: value})
    try:
        validate(cfg)
    except ConfigError as exc:
        key, sep, rest = str(exc).partition(":")
        if sep and key in given:
            raise ConfigError(f"{flag_name(given[key])}:{rest} (sets {key})") from exc
        raise
    return cfg
