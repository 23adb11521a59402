"""The proxy's shell stays thin glue: no function in ``kvproxy/proxy/`` over 50 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import kvproxy

PROXY = Path(kvproxy.__file__).parent / "proxy"
MAX_LINES = 50


def test_no_function_in_proxy_over_the_cap() -> None:
    long: list[str] = []
    for path in sorted(PROXY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert not long, long
