"""The compiled build's switch and module list (kvproxy/compiled.py, setup.py).

``scripts/check_compiled.sh`` runs the unit tests and the request path's real-stack
tests again on a ``KVPROXY_COMPILE=1`` wheel with ``KVPROXY_EXPECT_COMPILED=1``; the
last test here then checks that they really ran compiled code (and, in the plain run,
``KVPROXY_EXPECT_COMPILED=0``, that they ran the Python source).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

import kvproxy
from kvproxy import compiled
from kvproxy.doctor.checks import Status, build_lines

ROOT = Path(kvproxy.__file__).parent


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), (" YES ", True), ("0", False), ("", False), ("no", False)],
)
def test_the_switch_reads_the_usual_spellings(value: str, on: bool) -> None:
    assert compiled.compile_requested({compiled.COMPILE_ENV: value}) is on
    assert compiled.compile_requested({}) is False


def test_every_listed_module_is_a_product_module_with_its_source() -> None:
    assert len(set(compiled.MODULES)) == len(compiled.MODULES)
    for name in compiled.MODULES:
        parts = name.split(".")
        assert parts[0] == "kvproxy" and parts[1] not in {"sim", "workload", "lab", "demo"}
        assert ROOT.joinpath(*parts[1:]).with_suffix(".py").is_file(), name


def _class_names(name: str) -> set[str]:
    path = ROOT.joinpath(*name.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def test_no_module_outside_the_list_subclasses_a_compiled_class() -> None:
    """A compiled class cannot be subclassed from Python: a module left out of the list
    (or a test) that subclasses one breaks only the compiled build."""
    listed = {c for name in compiled.MODULES for c in _class_names(name)}
    listed_files = {ROOT.joinpath(*n.split(".")[1:]).with_suffix(".py") for n in compiled.MODULES}
    offenders = []
    for path in [*ROOT.rglob("*.py"), *ROOT.parent.joinpath("tests").rglob("*.py")]:
        if path in listed_files:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                offenders += [f"{path.name}:{node.name}({b})" for b in bases & listed]
    assert offenders == []


def test_doctor_says_which_build_runs() -> None:
    assert build_lines(25, 25)[0].status is Status.OK
    assert "compiled" in build_lines(25, 25)[0].render()
    assert build_lines(0, 25)[0].status is Status.OK
    assert "KVPROXY_COMPILE=1" in build_lines(0, 25)[0].render()
    assert build_lines(3, 25)[0].status is Status.WARN


def test_the_build_is_named_for_the_start_up_line() -> None:
    assert compiled.build_name(compiled.MODULES) == "compiled"
    assert compiled.build_name(()) == "python"
    assert (
        compiled.build_name(compiled.MODULES[:3])
        == f"mixed (3 of {len(compiled.MODULES)} compiled)"
    )


def test_the_run_ran_the_build_it_expects() -> None:
    expected = os.environ.get("KVPROXY_EXPECT_COMPILED")
    found = compiled.compiled_modules()
    if expected == "1":
        assert found == compiled.MODULES
    elif expected == "0":
        assert found == ()
    else:  # a developer's run: either build, but never a mix of the two
        assert found in ((), compiled.MODULES)
