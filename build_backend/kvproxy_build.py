"""The build backend: setuptools', with what mypyc needs to compile the request path
added to the build requirements when ``KVPROXY_COMPILE=1`` asks for it, so that
``KVPROXY_COMPILE=1 pip install .`` needs nothing installed beforehand, in a fresh
virtualenv too.

mypyc type-checks the modules it compiles, so it needs mypy and the types of every
import: kvproxy's own dependencies (``pyproject.toml``'s ``[project] dependencies``,
read from there, not repeated here), PyYAML's stubs, and numpy (imported by the
optional vectorised count). pip builds before it installs the dependencies, so they are
build requirements too; without them the build stops on "cannot find implementation or
library stub" unless the environment happens to have them installed already."""

from __future__ import annotations

import os
import runpy
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (the backend's other hooks, unchanged)

_ROOT = Path(__file__).resolve().parent.parent
# What the type check needs beyond the project's dependencies.
_COMPILER = ["mypy>=1.10", "types-PyYAML", "numpy>=1.24"]


# The switch is kvproxy/compiled.py's, read without importing the package.
_compiled = runpy.run_path(str(_ROOT / "kvproxy/compiled.py"))
_SWITCH: str = _compiled["COMPILE_ENV"]


def _dependencies() -> list[str]:
    with open(_ROOT / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def _compiler() -> list[str]:
    if not _compiled["compile_requested"](os.environ):
        return []
    return [*_COMPILER, *_dependencies()]


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
