"""The wire body to scheduler request path shared by the HTTP simulator and the lab."""

from __future__ import annotations

from typing import Any

import pytest

from kvlab.sim.parse import BadRequest, parse_generate, parse_openai, scheduler_request


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 7}, "rid": "a"},
            {"rid": "a", "input_ids": [1, 2, 3], "max_new_tokens": 7, "priority": None},
        ),
        (
            {"input_ids": [5], "rid": "b", "priority": 3, "session_id": "s", "stream": True},
            {"rid": "b", "max_new_tokens": 128, "priority": 3, "session_id": "s", "stream": True},
        ),
    ],
)
def test_generate_body_builds_the_scheduler_request(
    body: dict[str, Any], expected: dict[str, Any]
) -> None:
    req, _ = scheduler_request(parse_generate(body))
    for name, value in expected.items():
        assert getattr(req, name) == value, name


def test_submit_options_carry_the_sampling_fields() -> None:
    body = {
        "input_ids": [1, 2],
        "rid": "r",
        "session_params": {"id": "s1", "rid": None},
        "sampling_params": {
            "stop_token_ids": [9, 10],
            "ignore_eos": True,
            "custom_params": {"sim_output_len": 4},
        },
    }
    req, options = scheduler_request(parse_generate(body))
    assert options == {
        "session_params": {"id": "s1", "rid": None},
        "output_len": 4,
        "stop_token_ids": (9, 10),
        "ignore_eos": True,
    }
    assert req.session_id is None and req.stream is False


def test_stream_override_counts_a_whole_answer_as_not_streamed() -> None:
    p = parse_generate({"input_ids": [1], "stream": True})
    assert scheduler_request(p)[0].stream is True
    assert scheduler_request(p, stream=False)[0].stream is False


def test_openai_body_builds_the_same_request_shape() -> None:
    p = parse_openai({"prompt": [4, 5, 6], "max_tokens": 3, "rid": "o"}, chat=False)
    req, options = scheduler_request(p)
    assert (req.rid, req.input_ids, req.max_new_tokens) == ("o", [4, 5, 6], 3)
    assert options["stop_token_ids"] == ()


def test_bad_body_is_a_clear_error() -> None:
    with pytest.raises(BadRequest, match="input_ids must be a list of integers"):
        parse_generate({"input_ids": [1, "x"]})


def test_responses_body_reads_input_request_id_and_session_id() -> None:
    from kvlab.sim.parse import parse_responses

    p = parse_responses(
        {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "instructions": "be brief",
            "max_output_tokens": 4,
            "request_id": "resp_1",
            "session_id": "s1",
        }
    )
    assert (p.rid, p.session_id) == ("resp_1", "s1")
    assert parse_responses({"input": "hello"}).session_id is None
    for bad in ({"input": []}, {"input": [{"role": "user"}]}, {"input": "x", "stream": True}):
        with pytest.raises(BadRequest):
            parse_responses(bad)
