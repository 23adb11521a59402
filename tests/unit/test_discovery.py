import pytest

from kvproxy.fleet.discovery import (
    DiscoveryError,
    RouterFlavor,
    base_url,
    parse_list_workers,
    parse_workers,
    static_engines,
)

SMG_1_13 = {
    "workers": [
        {
            "id": "01a2",
            "url": "http://127.0.0.1:31041",
            "labels": {"dp_size": "1"},
            "is_healthy": True,
        },
        {
            "id": "01a3",
            "url": "http://127.0.0.1:31042/",
            "labels": {"dp_size": "1"},
            "is_healthy": False,
        },
    ],
    "total": 2,
    "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": 2},
}
ROUTER_0_3_2_DP = {
    "workers": [
        {
            "id": "117b",
            "url": "http://127.0.0.1:31011@0",
            "metadata": {"dp_size": "3"},
            "is_healthy": True,
        },
        {
            "id": "117c",
            "url": "http://127.0.0.1:31011@1",
            "metadata": {"dp_size": "3"},
            "is_healthy": True,
        },
        {
            "id": "117d",
            "url": "http://127.0.0.1:31011@2",
            "metadata": {"dp_size": "3"},
            "is_healthy": False,
        },
        {"id": "118a", "url": "http://127.0.0.1:31012", "metadata": {}, "is_healthy": True},
    ],
    "total": 4,
}


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:31011@2", "http://127.0.0.1:31011"),
        ("http://127.0.0.1:31011/", "http://127.0.0.1:31011"),
        ("http://h:1", "http://h:1"),
    ],
)
def test_base_url(url: str, expected: str) -> None:
    assert base_url(url) == expected


def test_smg_shape() -> None:
    found = parse_workers(SMG_1_13)
    assert found.flavor is RouterFlavor.SMG and not found.legacy
    assert found.healthy == ("http://127.0.0.1:31041",)
    assert found.unhealthy == ("http://127.0.0.1:31042",)
    assert found.all == ("http://127.0.0.1:31041", "http://127.0.0.1:31042")


def test_legacy_dp_aware_shape_is_deduplicated() -> None:
    found = parse_workers(ROUTER_0_3_2_DP)
    assert found.flavor is RouterFlavor.LEGACY_WORKERS and found.legacy
    # healthy on some rank -> healthy; listed once
    assert found.healthy == ("http://127.0.0.1:31011", "http://127.0.0.1:31012")
    assert found.unhealthy == ()


def test_list_workers_fallback() -> None:
    found = parse_list_workers({"urls": ["http://a:1", "http://a:1@0", "http://b:2", 7]})
    assert found.healthy == ("http://a:1", "http://b:2")
    assert found.flavor is RouterFlavor.LEGACY_LIST and found.legacy


@pytest.mark.parametrize("doc", [None, [], {"workers": {}}, {"urls": "x"}])
def test_bad_shapes_raise(doc: object) -> None:
    with pytest.raises(DiscoveryError):
        parse_workers(doc)
    with pytest.raises(DiscoveryError):
        parse_list_workers(doc)


def test_static_list_overrides() -> None:
    found = static_engines(("http://a:1/", "http://a:1"))
    assert found.healthy == ("http://a:1",) and found.flavor is RouterFlavor.STATIC
