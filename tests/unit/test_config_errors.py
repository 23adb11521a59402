"""Configuration errors that name the fix: duplicated keys, near-miss keys, flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvproxy.config import ConfigError, apply_overrides, flag_name, from_mapping, load_config
from kvproxy.yamlload import DuplicateKeyError, load_yaml


def test_a_duplicated_section_is_rejected_with_both_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(
        "admission:\n  enabled: true\nserver:\n  port: 8100\nadmission:\n  headroom: 0.5\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: duplicate key 'admission' at line 5 (first at line 1)"


def test_a_duplicated_nested_key_is_rejected() -> None:
    with pytest.raises(DuplicateKeyError) as info:
        load_yaml("admission:\n  headroom: 0.8\n  scope: all\n  headroom: 0.9\n")
    assert (info.value.key, info.value.first_line, info.value.line) == ("headroom", 2, 4)


def test_merge_keys_are_not_duplicates() -> None:
    doc = load_yaml("base: &b\n  a: 1\n  b: 2\nderived:\n  <<: *b\n  a: 3\n")
    assert doc["derived"] == {"a": 3, "b": 2}


def test_plain_yaml_still_parses_like_safe_load() -> None:
    assert load_yaml("a: [1, 2]\nb: {c: null}\n") == {"a": [1, 2], "b": {"c": None}}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"admission": {"headrom": 0.5}},
            "admission.headrom: unknown key; did you mean admission.headroom?",
        ),
        ({"server": {"prot": 1}}, "server.prot: unknown key; did you mean server.port?"),
        (
            {"session_lifecycle": {"idle_timeout": 5}},
            "session_lifecycle.idle_timeout: unknown key; did you mean session_lifecycle.idle_timeout_s?",
        ),
        ({"admision": {}}, "admision: unknown section; did you mean admission?"),
    ],
)
def test_an_unknown_key_suggests_the_closest_valid_one(doc: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(doc)
    assert str(info.value).startswith(message)
    assert "(allowed: " in str(info.value)


def test_no_suggestion_when_nothing_is_close() -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"server": {"zzzzqqq": 1}})
    assert "did you mean" not in str(info.value)
    assert str(info.value).startswith("server.zzzzqqq: unknown key (allowed: ")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"agentic_program_admission": True, "agentic_admission_max_wait_s": -1.0},
            "--agentic-admission-max-wait-s: must be >= 0 (got -1.0) (sets admission.max_wait_s)",
        ),
        ({"port": 0}, "--port: must be in [1, 65535] (got 0) (sets server.port)"),
        (
            {"router_url": "ftp://x"},
            "--router-url: must be an http(s) URL (got 'ftp://x') (sets router.url)",
        ),
        (
            {"agentic_program_admission": True, "agentic_admission_headroom": 1.5},
            "--agentic-admission-headroom: must be in (0, 1] (got 1.5) (sets admission.headroom)",
        ),
    ],
)
def test_an_error_in_a_flag_names_the_flag(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(from_mapping({}), overrides)
    assert str(info.value) == message


def test_an_error_from_the_yaml_keeps_the_yaml_key() -> None:
    # max_wait_s came from the file; the flag only turned admission on.
    cfg = from_mapping({"admission": {"max_wait_s": -1}})
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, {"agentic_program_admission": True})
    assert str(info.value) == "admission.max_wait_s: must be >= 0 (got -1.0)"


def test_flag_name() -> None:
    assert flag_name("agentic_admission_scope") == "--agentic-admission-scope"
