"""Configuration: typed, frozen dataclasses loaded from one YAML file.

Pure: no I/O except :func:`load_config`, which reads the file. Validation errors
name the offending key and its allowed range. A feature's constraints are only
checked when that feature is enabled, so a half-filled ``admission:`` block never
stops a proxy that runs with admission off.

Precedence: defaults < YAML < CLI overrides (``apply_overrides``).

One module per YAML section holds that section's dataclass (every key, its default
and a comment) and its validator: :mod:`~kvproxy.config.server`,
:mod:`~kvproxy.config.router`, :mod:`~kvproxy.config.session_lifecycle`,
:mod:`~kvproxy.config.admission`. :mod:`~kvproxy.config.model` puts the sections
together (:class:`Config`, :func:`validate`), :mod:`~kvproxy.config.loading` reads
YAML into them, :mod:`~kvproxy.config.overrides` applies the CLI flags. Everything is
imported from here (``from kvproxy.config import ...``).

Adding a key: a field with its default and a comment in its section's dataclass, its
range in that module's validator (checked only when the feature is enabled), and a line
in ``configs/kvproxy.yaml`` and a row in ``docs/configuration.md`` (a test,
tests/unit/test_config_reference.py, fails until both state the default). Program
admission's parameters inherit every admission key
(:class:`~kvproxy.admission.program.params.ProgramParams`): nothing to add there. A key
that is a duration or a token count is also named in :mod:`kvproxy.admission.scaling`
(``TIME_SCALED``, ``TOKEN_SCALED``), so that the time and token scales apply to it.
"""

from __future__ import annotations

from kvproxy.config.admission import ADMISSION_MODES, AdmissionConfig
from kvproxy.config.errors import ConfigError
from kvproxy.config.loading import from_mapping, load_config
from kvproxy.config.model import SECTIONS, Config, LiveConfig, validate
from kvproxy.config.overrides import CLI_OVERRIDES, apply_overrides, flag_name
from kvproxy.config.router import ROUTER_POLICIES_MIRRORED, RouterConfig
from kvproxy.config.server import MAX_MALLOC_RETAIN, MIN_MALLOC_RETAIN, ServerConfig
from kvproxy.config.session_lifecycle import SESSION_ID_SOURCES, SessionLifecycleConfig
from kvproxy.config.state import STATE_BACKENDS, StateConfig

__all__ = [
    "ADMISSION_MODES",
    "CLI_OVERRIDES",
    "MAX_MALLOC_RETAIN",
    "MIN_MALLOC_RETAIN",
    "ROUTER_POLICIES_MIRRORED",
    "SECTIONS",
    "SESSION_ID_SOURCES",
    "STATE_BACKENDS",
    "AdmissionConfig",
    "Config",
    "ConfigError",
    "LiveConfig",
    "RouterConfig",
    "ServerConfig",
    "SessionLifecycleConfig",
    "StateConfig",
    "apply_overrides",
    "flag_name",
    "from_mapping",
    "load_config",
    "validate",
]
