"""The build backend's requirements: a compiled build brings everything mypyc type-checks
against, so that ``KVPROXY_COMPILE=1 pip install .`` works in a fresh virtualenv (pip
builds the wheel before it installs the dependencies). scripts/check_compiled.sh builds
that way; this checks the list itself."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def backend() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "kvproxy_build", ROOT / "build_backend" / "kvproxy_build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in requirements}


def test_a_compiled_build_requires_mypy_and_what_it_type_checks_against(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPROXY_COMPILE", "1")
    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    required = backend._compiler()
    assert set(dependencies) <= set(required)  # as declared, markers included
    assert {"mypy", "types-PyYAML", "numpy"} <= _names(required)


def test_a_plain_build_requires_nothing_more(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVPROXY_COMPILE", raising=False)
    assert backend._compiler() == []
    monkeypatch.setenv("KVPROXY_COMPILE", "0")
    assert backend._compiler() == []
