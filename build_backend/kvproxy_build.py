"""The build backend: setuptools', with mypy (whose mypyc compiles the request path)
added to the build requirements when ``KVPROXY_COMPILE=1`` asks for it, so that
``KVPROXY_COMPILE=1 pip install .`` needs nothing installed beforehand."""

from __future__ import annotations

import os
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (the backend's other hooks, unchanged)

_COMPILER = ["mypy>=1.10"]


# The switch is kvproxy/compiled.py's, read without importing the package.
_compiled = runpy.run_path(str(Path(__file__).resolve().parent.parent / "kvproxy/compiled.py"))
_SWITCH: str = _compiled["COMPILE_ENV"]


def _compiler() -> list[str]:
    return _COMPILER if _compiled["compile_requested"](os.environ) else []


def _without_compiling(hook: Callable[[Any], list[str]], config_settings: Any) -> list[str]:
    """setuptools' own requirements: it runs setup.py to find them, before mypy is
    there, so the switch is off while it does."""
    saved = os.environ.pop(_SWITCH, None)
    try:
        return hook(config_settings)
    finally:
        if saved is not None:
            os.environ[_SWITCH] = saved


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    base = _without_compiling(_setuptools.get_requires_for_build_wheel, config_settings)
    return [*base, *_compiler()]


def get_requires_for_build_editable(config_settings: Any = None) -> list[str]:
    base = _without_compiling(_setuptools.get_requires_for_build_editable, config_settings)
    return [*base, *_compiler()]
