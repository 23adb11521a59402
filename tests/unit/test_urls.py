"""The one URL normaliser."""

from __future__ import annotations

import pytest

from kvproxy.urls import base_url, join, unique_base_urls


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://h:1", "http://h:1"),
        ("http://h:1/", "http://h:1"),
        ("http://h:1@2", "http://h:1"),
        (" http://h:1// ", "http://h:1"),
        ("", ""),
    ],
)
def test_base_url(url: str, base: str) -> None:
    assert base_url(url) == base


def test_unique_base_urls_keeps_first_seen_order_and_drops_empty() -> None:
    assert unique_base_urls(["http://b:1@0", "http://a:1", "http://b:1@1", "/", ""]) == [
        "http://b:1",
        "http://a:1",
    ]


def test_join() -> None:
    assert join("http://h:1/", "/metrics") == "http://h:1/metrics"
