"""The code's shape: each module states its one role, and no function outgrows a screen.

* **One role a module, stated.** Every module of the product (``kvproxy/``), the tools
  (``kvlab/``) and ``scripts/``, packages' ``__init__`` included, opens with a docstring
  whose first line says what the module is for: a sentence (its summary paragraph ends
  with ``.``, ``?`` or ``!``) that names more than the module itself. That is what a
  line cap used to stand for; where a module splits is decided by its roles, not by a
  count of lines.
* **Functions stay readable**: none in the product or the tools over 100 lines, none in
  the proxy's shell (``kvproxy/proxy/``) over 50: it stays thin glue.
* **A loose backstop on module size** (1,200 lines, in all three trees; the largest
  module here is near 1,100): not a design rule, a smoke alarm for a module that kept growing
  while nobody re-read its role line. Crossing it means re-reading the role, not cutting
  at a line count.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import kvlab
import kvproxy

PRODUCT = Path(kvproxy.__file__).parent
TOOLS = Path(kvlab.__file__).parent
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PROXY = PRODUCT / "proxy"
MAX_PROXY_FUNCTION_LINES = 50
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 1200

# Words that, with the module's own dotted name, do not state a role by themselves.
_FILLER = frozenset({"a", "an", "the", "of", "for", "and", "module", "package", "init", "main"})
# The summary paragraph ends a sentence (closing quotes, brackets or markup may follow).
_SENTENCE_END = re.compile(r"[.?!][)\]\"'`*]*$")


def _modules() -> list[Path]:
    return sorted([*PRODUCT.rglob("*.py"), *TOOLS.rglob("*.py"), *SCRIPTS.rglob("*.py")])


def _name(path: Path) -> str:
    """``kvlab/sim/scheduler.py`` -> ``kvlab.sim.scheduler`` (scripts: ``scripts.x``)."""
    base = SCRIPTS.parent if path.is_relative_to(SCRIPTS) else PRODUCT.parent
    return ".".join(path.relative_to(base).with_suffix("").parts)


def role_problem(dotted: str, source: str) -> str | None:
    """What is missing from a module's role statement, or None when it has one."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    if doc is None:
        return "no module docstring (its first line should state the module's role)"
    first = doc.splitlines()[0].strip() if doc else ""
    if not first:
        return "the docstring's first line is empty (start the role on the first line)"
    words = re.findall(r"[a-z0-9]+", first.lower())
    own = set(re.findall(r"[a-z0-9]+", dotted.lower())) | _FILLER
    if len([w for w in words if w not in own]) < 2:
        return f"the first line {first!r} only names the module; say what it is for"
    summary = " ".join(doc.strip().split("\n\n")[0].split())
    if not _SENTENCE_END.search(summary):
        return f"the first line {first!r} does not read as a sentence (end it with '.')"
    return None


def test_role_check_tells_a_role_from_a_name() -> None:
    assert role_problem("kvlab.sim.decode", '"""Decode steps of one rank."""') is None
    assert role_problem("kvproxy", '"""kvproxy: a KV-cache-aware reverse proxy."""') is None
    wrapped = '"""What one rank accepts of a request,\nand how long its output will be.\n"""'
    assert role_problem("kvlab.sim.intake", wrapped) is None
    assert "no module docstring" in str(role_problem("kvlab.x", "import os\n"))
    assert "empty" in str(role_problem("kvlab.x", '"""\nThe role, a line late."""'))
    assert "only names" in str(role_problem("kvlab.sim.scheduler", '"""Scheduler."""'))
    assert "only names" in str(role_problem("kvlab.sim.scheduler", '"""The scheduler module."""'))
    assert "sentence" in str(role_problem("kvlab.x", '"""Prefill of one rank\n\nMore."""'))


def test_every_module_states_its_role_in_its_first_docstring_line() -> None:
    problems = []
    for path in _modules():
        problem = role_problem(_name(path), path.read_text())
        if problem is not None:
            problems.append(f"{path.relative_to(SCRIPTS.parent)}: {problem}")
    assert not problems, "\n".join(problems)


def _functions(paths: list[Path]) -> Iterator[tuple[str, int]]:
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                yield f"{path.relative_to(path.parents[1])}:{node.name} ({lines} lines)", lines


def test_no_function_in_proxy_over_its_cap() -> None:
    paths = sorted(PROXY.glob("*.py"))
    long = [name for name, n in _functions(paths) if n > MAX_PROXY_FUNCTION_LINES]
    assert not long, long


def test_no_function_in_product_or_tools_over_the_cap() -> None:
    paths = sorted(PRODUCT.rglob("*.py")) + sorted(TOOLS.rglob("*.py"))
    long = [name for name, n in _functions(paths) if n > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_module_past_the_size_backstop() -> None:
    big = sorted(
        f"{path.relative_to(SCRIPTS.parent)} ({n} lines): past the backstop; one role still?"
        for path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert not big, big
