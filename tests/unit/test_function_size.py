"""Size caps that keep the code readable: the proxy's shell stays thin glue (no function
in ``kvproxy/proxy/`` over 50 lines), no function anywhere in the product or the tools
over 100 lines, and no product module over 700 lines."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvlab
import kvproxy

PRODUCT = Path(kvproxy.__file__).parent
TOOLS = Path(kvlab.__file__).parent
PROXY = PRODUCT / "proxy"
MAX_PROXY_FUNCTION_LINES = 50
MAX_FUNCTION_LINES = 100
MAX_PRODUCT_MODULE_LINES = 700


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


def test_no_product_module_over_the_cap() -> None:
    sizes = {path: len(path.read_text().splitlines()) for path in PRODUCT.rglob("*.py")}
    big = sorted(
        f"{path.relative_to(PRODUCT)} ({n} lines)"
        for path, n in sizes.items()
        if n > MAX_PRODUCT_MODULE_LINES
    )
    assert not big, big
