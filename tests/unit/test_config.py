from pathlib import Path

import pytest

from kvproxy.config import Config, ConfigError, apply_overrides, from_mapping, load_config

REPO = Path(__file__).resolve().parents[2]


def test_shipped_yaml_matches_the_defaults() -> None:
    shipped = load_config(REPO / "configs" / "kvproxy.yaml")
    defaults = Config()
    for section in ("server", "router", "session_lifecycle", "admission"):
        assert getattr(shipped, section) == getattr(defaults, section), section
    assert not shipped.session_lifecycle.enabled
    assert not shipped.admission.enabled


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"server": {"port": 0}}, "server.port"),
        ({"server": {"admin_token": ""}}, "server.admin_token: must be null or a non-empty"),
        ({"server": {"admin_token": " padded "}}, "server.admin_token"),
        ({"server": {"public_stats": "no"}}, "server.public_stats"),
        ({"server": {"bogus": 1}}, "server.bogus: unknown key"),
        ({"nope": {}}, "nope: unknown section"),
        ({"router": {"url": "ftp://x"}}, "router.url"),
        ({"router": {"engines": "http://a"}}, "router.engines: must be a list"),
        (
            {"admission": {"enabled": True, "headroom": 1.5}},
            "admission.headroom: must be in (0, 1]",
        ),
        ({"admission": {"enabled": True, "headroom": 0}}, "admission.headroom"),
        ({"admission": {"enabled": True, "pressure_threshold": 0}}, "admission.pressure_threshold"),
        (
            {"admission": {"enabled": True, "scope": "eval"}},
            "admission.scope: must be train or all",
        ),
        ({"admission": {"enabled": True, "max_wait_s": -1}}, "admission.max_wait_s"),
        (
            {"admission": {"enabled": True, "expected_decode_cap": 0}},
            "admission.expected_decode_cap",
        ),
        ({"admission": {"enabled": "yes"}}, "admission.enabled: must be true or false"),
        (
            {"session_lifecycle": {"enabled": True, "on_close": "kill"}},
            "session_lifecycle.on_close",
        ),
        (
            {"session_lifecycle": {"enabled": True, "close_timeout_s": 0}},
            "session_lifecycle.close_timeout_s",
        ),
        (
            {"session_lifecycle": {"enabled": True, "id_sources": ["cookie"]}},
            "session_lifecycle.id_sources",
        ),
        ({"server": {"gc_threshold": 50}}, "server.gc_threshold: must be 0"),
        ({"server": {"gc_threshold": "many"}}, "server.gc_threshold"),
    ],
)
def test_invalid_values_name_the_key(doc: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(doc)
    assert needle in str(info.value)


def test_feature_constraints_only_checked_when_enabled() -> None:
    cfg = from_mapping({"admission": {"headroom": 7.0}, "session_lifecycle": {"on_close": "x"}})
    assert cfg.admission.headroom == 7.0


def test_cli_overrides_win_and_are_validated() -> None:
    cfg = from_mapping({"admission": {"enabled": False, "headroom": 0.5}})
    out = apply_overrides(
        cfg,
        {
            "agentic_program_admission": True,
            "agentic_admission_headroom": 0.8,
            "agentic_admission_scope": "all",
            "port": 9999,
            "router_url": None,
        },
    )
    assert out.admission.enabled and out.admission.headroom == 0.8
    assert out.admission.scope == "all" and out.server.port == 9999
    assert out.router.url == cfg.router.url
    with pytest.raises(ConfigError, match=r"admission\.headroom"):
        apply_overrides(cfg, {"agentic_program_admission": True, "agentic_admission_headroom": 2.0})


def test_ints_accepted_for_floats_but_not_bools(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("admission:\n  max_wait_s: 5\n")
    assert load_config(p).admission.max_wait_s == 5.0
    p.write_text("admission:\n  max_wait_s: true\n")
    with pytest.raises(ConfigError, match=r"admission\.max_wait_s"):
        load_config(p)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("server: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)


def test_staleness_default_is_a_few_poll_intervals() -> None:
    cfg = from_mapping({"admission": {"poll_interval_s": 2.0}})
    assert cfg.admission.effective_staleness_s == 6.0
    cfg = from_mapping({"admission": {"poll_interval_s": 0.5}})
    assert cfg.admission.effective_staleness_s == 5.0


def test_session_residency_maps_to_mode_and_a_contradiction_names_the_replacement() -> None:
    from kvproxy.config import ConfigError, from_mapping

    on = {"enabled": True}
    assert from_mapping({"admission": on}).admission.mode == "program"
    assert from_mapping({"admission": {**on, "session_residency": False}}).admission.mode == (
        "request"
    )
    assert from_mapping({"admission": {**on, "session_residency": True}}).admission.mode == (
        "program"
    )
    with pytest.raises(ConfigError, match="replaced by mode"):
        from_mapping({"admission": {**on, "session_residency": False, "mode": "program"}})


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("admission", "mode", "fleet", "admission.mode"),
        ("admission", "ledger", "global", "admission.ledger"),
        ("admission", "priority_max", 10, "preempts"),
        ("admission", "pause_low", 0.99, "admission.pause_low"),
        ("admission", "paused_soft_wait_s", -1, "admission.paused_soft_wait_s"),
        ("server", "time_scale", 0, "server.time_scale"),
        ("router", "policy", "Consistent Hashing", "router.policy"),
        ("router", "metrics_url", "nope", "router.metrics_url"),
    ],
)
def test_program_keys_are_validated(section: str, key: str, value: object, message: str) -> None:
    from kvproxy.config import ConfigError, from_mapping

    doc: dict[str, dict[str, object]] = {"admission": {"enabled": True}}
    doc.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError, match=message):
        from_mapping(doc)


def test_gc_threshold_is_set_once_serving_and_zero_keeps_pythons() -> None:
    import gc

    from kvproxy.serve import apply_gc_threshold

    assert from_mapping({}).server.gc_threshold == 10_000
    assert from_mapping({"server": {"gc_threshold": 0}}).server.gc_threshold == 0
    before = gc.get_threshold()
    try:
        apply_gc_threshold(25_000)
        assert gc.get_threshold() == (25_000, before[1], before[2])
        apply_gc_threshold(0)  # Python's own: left as it is
        assert gc.get_threshold() == (25_000, before[1], before[2])
    finally:
        gc.set_threshold(*before)
