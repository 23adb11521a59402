import dataclasses
import math
from typing import Any

import pytest
from multidict import CIMultiDict

from kvproxy.admission import classify
from kvproxy.admission.reservation import (
    MESSAGE_OVERHEAD_CHARS,
    PromptCalibrator,
    ReservationSizer,
    completion_tokens,
    exact_prompt_tokens,
    prompt_chars,
)
from kvproxy.config import AdmissionConfig

CFG = AdmissionConfig(enabled=True, default_completion_tokens=1000, chars_per_token=4.0)


# -- prompt --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"input_ids": [1, 2, 3]}, 3),
        ({"input_ids": [[1, 2], [3, 4, 5]]}, 5),
        ({"input_ids": []}, 0),
        ({"prompt": [7, 8, 9, 10]}, 4),  # /v1/completions with token ids
        ({"prompt": [[7], [8, 9]]}, 3),
        ({"prompt": "hello"}, None),
        ({"text": "hello"}, None),
        ({"input_ids": "not a list"}, None),
        ({}, None),
    ],
)
def test_exact_prompt_tokens(body: dict[str, Any], expected: int | None) -> None:
    assert exact_prompt_tokens(body) == expected


def test_prompt_chars_counts_text_messages_and_tools() -> None:
    assert prompt_chars({"text": "abcd"}) == 4
    assert prompt_chars({"text": ["ab", "cde"]}) == 5
    assert prompt_chars({"prompt": "x" * 10}) == 10
    body = {
        "messages": [
            {"role": "system", "content": "x" * 100},
            {
                "role": "user",
                "content": [{"type": "text", "text": "y" * 50}, {"type": "image_url"}],
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "r" * 7,
                "tool_calls": [{"function": {"name": "ls", "arguments": '{"p":"/"}'}}],
            },
        ],
        "tools": [{"type": "function", "function": {"name": "ls"}}],
    }
    tools_len = len('[{"type":"function","function":{"name":"ls"}}]')
    expected = (
        3 * MESSAGE_OVERHEAD_CHARS
        + len("system") + 100
        + len("user") + 50
        + len("assistant") + 7 + 2 + len('{"p":"/"}')
        + tools_len
    )  # fmt: skip
    assert prompt_chars(body) == expected


# -- completion ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/generate", {"sampling_params": {"max_new_tokens": 64}}, 64),
        ("/generate", {"sampling_params": {"max_new_tokens": 0}}, 0),
        ("/generate", {"sampling_params": {"max_new_tokens": 5000}}, 2000),  # capped
        ("/generate", {"sampling_params": {}}, 1000),  # default
        ("/generate", {}, 1000),
        ("/generate", {"sampling_params": {"max_new_tokens": 10, "n": 3}}, 30),
        ("/generate", {"input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 10}}, 20),
        ("/generate", {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 10}}, 30),
        (
            "/generate",
            {"sampling_params": [{"max_new_tokens": 10}, {"max_new_tokens": 3000}, {}]},
            10 + 2000 + 1000,
        ),
        ("/v1/chat/completions", {"max_tokens": 100}, 100),
        ("/v1/chat/completions", {"max_completion_tokens": 50, "max_tokens": 100}, 50),
        ("/v1/chat/completions", {"max_tokens": 100, "n": 2}, 200),
        ("/v1/completions", {"max_tokens": 7}, 7),
        ("/v1/chat/completions", {"nvext": {"agent_hints": {"osl": 300}}}, 300),
        # An explicit limit wins over the hint.
        ("/v1/chat/completions", {"max_tokens": 80, "nvext": {"agent_hints": {"osl": 300}}}, 80),
        ("/generate", {"nvext": {"agent_hints": {"osl": 9000}}}, 2000),  # hint capped
        ("/v1/chat/completions", {"max_tokens": -5}, 1000),  # invalid -> default
        ("/v1/chat/completions", {"max_tokens": True}, 1000),
        ("/v1/chat/completions", {"max_tokens": 12.0}, 12),
        # A native field on an OpenAI path still counts when nothing else is given.
        ("/v1/chat/completions", {"sampling_params": {"max_new_tokens": 33}}, 33),
    ],
)
def test_completion_tokens(path: str, body: dict[str, Any], expected: int) -> None:
    assert completion_tokens(path, body, default=1000, cap=2000) == expected


def test_completion_cap_from_config() -> None:
    assert AdmissionConfig(default_completion_tokens=1000).completion_cap == 1000
    cfg = AdmissionConfig(default_completion_tokens=1000, expected_decode_cap=20)
    sizer = ReservationSizer(cfg)
    # Relax's worked example: prompt 108, max_new_tokens 56, cap 20 -> 128.
    res = sizer.size(
        "/generate",
        {"input_ids": list(range(108)), "sampling_params": {"max_new_tokens": 56}},
        None,
    )
    assert (res.prompt_tokens, res.completion_tokens, res.tokens, res.prompt_source) == (
        108,
        20,
        128,
        "input_ids",
    )


# -- sizing and calibration ----------------------------------------------------------------


def test_text_prompt_uses_default_ratio_then_learns_per_session() -> None:
    sizer = ReservationSizer(CFG)
    body = {"text": "x" * 1000, "sampling_params": {"max_new_tokens": 10}}
    res = sizer.size("/generate", body, "s1")
    assert (res.prompt_tokens, res.prompt_source, res.prompt_chars) == (250, "default", 1000)
    sizer.observe(body, "s1", 500)  # this session's text is 2 chars / token
    res = sizer.size("/generate", body, "s1")
    assert (res.prompt_tokens, res.prompt_source) == (500, "session")
    # Another session falls back to the fleet-wide estimate (seeded by the first report,
    # then moving slowly).
    other = sizer.size("/generate", body, "s2")
    assert (other.prompt_tokens, other.prompt_source) == (500, "global")
    sizer.observe(body, "s3", 250)  # 4 chars / token
    other = sizer.size("/generate", body, "s2")
    assert 450 < other.prompt_tokens < 500
    assert sizer.size("/generate", body, "s1").prompt_tokens == 500  # s1 unaffected


def test_observe_ignores_exact_prompts_and_bad_reports() -> None:
    sizer = ReservationSizer(CFG)
    sizer.observe({"input_ids": [1, 2, 3]}, "s", 3)
    sizer.observe({"text": "abc"}, "s", 0)
    sizer.observe({"text": ""}, "s", 10)
    assert len(sizer.calibrator) == 0
    assert sizer.calibrator.chars_per_token("s") == (4.0, "default")


def test_calibrator_ewma_clamp_and_lru_bound() -> None:
    cal = PromptCalibrator(4.0, max_sessions=2, alpha=0.5, global_alpha=0.5)
    cal.observe("a", 300, 100)  # 3.0
    cal.observe("a", 500, 100)  # 5.0 -> EWMA 4.0
    assert cal.chars_per_token("a") == (4.0, "session")
    cal.observe("b", 10_000, 1)  # clamped to 16
    assert cal.chars_per_token("b") == (16.0, "session")
    cal.chars_per_token("a")  # touch a: b becomes least recently used
    cal.observe("c", 200, 100)
    assert len(cal) == 2
    assert cal.chars_per_token("b")[1] == "global"
    assert cal.chars_per_token("a")[1] == "session"
    cal.observe(None, 100, 100)  # no session: only the global estimate learns
    assert len(cal) == 2


def test_sizer_configure_applies_new_defaults() -> None:
    sizer = ReservationSizer(CFG)
    sizer.configure(dataclasses.replace(CFG, chars_per_token=2.0, default_completion_tokens=10))
    res = sizer.size("/v1/chat/completions", {"prompt": "x" * 9}, None)
    assert (res.prompt_tokens, res.completion_tokens) == (math.ceil(9 / 2.0), 10)


def test_no_prompt_at_all() -> None:
    res = ReservationSizer(CFG).size("/generate", {"input_embeds": [[0.1]]}, None)
    assert (res.prompt_tokens, res.prompt_source, res.tokens) == (0, "none", 1000)


# -- classification ------------------------------------------------------------------------


def H(**kv: str) -> CIMultiDict[str]:
    return CIMultiDict({k.replace("_", "-"): v for k, v in kv.items()})


# Client headers honoured (admission.trust_client_headers).
T = AdmissionConfig(trust_client_headers=True)


@pytest.mark.parametrize(
    ("cfg", "path", "headers", "expected"),
    [
        (T, "/generate", H(), True),
        (T, "/generate", H(x_kvproxy_mode="eval"), False),
        (T, "/generate", H(X_KVPROXY_MODE=" EVAL "), False),
        (T, "/generate", H(x_kvproxy_mode="train"), True),
        (
            AdmissionConfig(scope="all", trust_client_headers=True),
            "/generate",
            H(x_kvproxy_mode="eval"),
            True,
        ),
        (AdmissionConfig(eval_path_prefix="/eval"), "/eval/generate", H(), False),
        (AdmissionConfig(eval_path_prefix="/eval"), "/generate", H(), True),
        (
            AdmissionConfig(eval_header="X-Run", trust_client_headers=True),
            "/generate",
            H(x_run="eval"),
            False,
        ),
        # Untrusted (the default): the header is ignored.
        (AdmissionConfig(), "/generate", H(x_kvproxy_mode="eval"), True),
        (AdmissionConfig(eval_header="X-Run"), "/generate", H(x_run="eval"), True),
        # A plain dict with a lower-case key also works.
        (T, "/generate", {"x-kvproxy-mode": "eval"}, False),
    ],
)
def test_in_scope(cfg: AdmissionConfig, path: str, headers: Any, expected: bool) -> None:
    assert classify.in_scope(cfg, path, headers) is expected


@pytest.mark.parametrize(
    ("cfg", "headers", "body", "expected"),
    [
        (AdmissionConfig(), H(), {}, False),
        (T, H(x_kvproxy_protected="true"), {}, True),
        (T, H(x_kvproxy_protected="1"), {}, True),
        (T, H(x_kvproxy_protected="no"), {}, False),
        # Untrusted (the default): the header is ignored.
        (AdmissionConfig(), H(x_kvproxy_protected="true"), {}, False),
        # Without protected_priority, priority never protects.
        (AdmissionConfig(), H(), {"priority": 100}, False),
        (AdmissionConfig(protected_priority=10), H(), {"priority": 10}, True),
        (AdmissionConfig(protected_priority=10), H(), {"priority": 9}, False),
        (
            AdmissionConfig(protected_priority=10),
            H(),
            {"nvext": {"agent_hints": {"priority": 11}}},
            True,
        ),
        # The top-level field wins over the hint.
        (
            AdmissionConfig(protected_priority=10),
            H(),
            {"priority": 1, "nvext": {"agent_hints": {"priority": 11}}},
            False,
        ),
        (AdmissionConfig(protected_priority=10), H(), {"priority": "high"}, False),
        (AdmissionConfig(protected_priority=10), H(), {"priority": True}, False),
    ],
)
def test_is_protected(
    cfg: AdmissionConfig, headers: Any, body: dict[str, Any], expected: bool
) -> None:
    assert classify.is_protected(cfg, headers, body) is expected


def test_the_shared_prefix_is_learned_and_not_charged_per_request() -> None:
    sizer = ReservationSizer(CFG)
    body = {"input_ids": [1] * 3000, "sampling_params": {"max_new_tokens": 50}}
    assert sizer.size("/generate", body, "s").tokens == 3050  # nothing learned yet
    for _ in range(40):  # first requests of sessions found 1,000 tokens cached
        sizer.observe_shared(1000)
    r = sizer.size("/generate", body, "s")
    assert r.shared_tokens == 999 or r.shared_tokens == 1000  # EWMA converges from below
    assert r.tokens == 3050 - r.shared_tokens
    small = {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 50}}
    # never below the completion budget: the prompt part bottoms out at 0
    assert sizer.size("/generate", small, "s").tokens == 50
    sizer.observe_shared(-5)  # nonsense reports are ignored
    assert sizer.size("/generate", body, "s").shared_tokens == r.shared_tokens
