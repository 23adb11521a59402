"""The admission decision's response headers: values, and the shared unwaited ones."""

from __future__ import annotations

import pytest

from kvproxy.proxy.handlers import _admission_headers


@pytest.mark.parametrize(
    ("action", "reason", "wait_s", "expected"),
    [
        ("admit", "capacity_available", 0.0, ("admit", "0.0", "capacity_available")),
        ("admit", "capacity_available", 0.01234, ("admit", "12.3", "capacity_available")),
        ("bypass", "degraded", 0.0, ("bypass; reason=degraded", "0.0", "degraded")),
        ("bypass", "aged", 30.0, ("bypass; reason=aged", "30000.0", "aged")),
    ],
)
def test_values(action: str, reason: str, wait_s: float, expected: tuple[str, str, str]) -> None:
    headers = _admission_headers(action, reason, wait_s)
    assert (
        headers["X-KVProxy-Admission"],
        headers["X-KVProxy-Admission-Wait-Ms"],
        headers["X-KVProxy-Admission-Decision"],
    ) == expected
    assert len(headers) == 3


def test_unwaited_decisions_share_one_read_only_mapping() -> None:
    first = _admission_headers("admit", "capacity_available", 0.0)
    assert _admission_headers("admit", "capacity_available", 0.0) is first
    assert _admission_headers("bypass", "protected", 0.0) is not first
    with pytest.raises(TypeError):
        first["X-KVProxy-Admission"] = "changed"  # type: ignore[index]


def test_waited_decisions_are_not_shared() -> None:
    a = _admission_headers("admit", "capacity_available", 0.5)
    b = _admission_headers("admit", "capacity_available", 0.5)
    assert a == b and a is not b
