"""Session identity from Dynamo's canonical headers and the coding agents' own headers;
parent links; bad or conflicting identity (docs/sessions.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvproxy.config import SESSION_ID_SOURCES, SessionLifecycleConfig
from kvproxy.sessions.identity import (
    NOTE_CONFLICT,
    NOTE_NVEXT,
    NOTE_PARENT_INVALID,
    NOTE_PARENT_SELF,
    NOTE_REJECTED,
    InvalidSessionId,
    injection_plan,
    resolve_identity,
)

ON = SessionLifecycleConfig(enabled=True)
LONG = "x" * 129  # one over the default id_max_length


def resolve(
    headers: dict[str, str],
    body: dict[str, Any] | None = None,
    *,
    path_id: str | None = None,
    cfg: SessionLifecycleConfig = ON,
) -> tuple[str | None, str | None, str | None, bool, tuple[str, ...]]:
    ident = resolve_identity(cfg, path_session_id=path_id, headers=headers, body=body or {})
    return ident.session_id, ident.source, ident.parent_id, ident.close_after, ident.notes


def test_default_order_puts_dynamo_then_agents_before_kvproxys_own() -> None:
    # Every source carries its own id; taking the winner away each time walks the order.
    headers = {
        "X-Dynamo-Session-ID": "from-dynamo",
        "x-claude-code-session-id": "from-claude-code",
        "session-id": "from-codex",
        "X-Session-ID": "from-header",
        "X-SMG-Routing-Key": "from-routing-key",
    }
    body: dict[str, Any] = {
        "session_id": "from-body",
        "nvext": {"session_control": {"session_id": "from-nvext"}},
    }
    drop = {
        "dynamo": lambda: headers.pop("X-Dynamo-Session-ID"),
        "claude_code": lambda: headers.pop("x-claude-code-session-id"),
        "codex": lambda: headers.pop("session-id"),
        "body": lambda: body.pop("session_id"),
        "header": lambda: headers.pop("X-Session-ID"),
        "nvext": lambda: body.pop("nvext"),
        "routing_key": lambda: headers.pop("X-SMG-Routing-Key"),
    }
    winners = []
    for _ in range(len(drop) + 1):
        sid, source, *_ = resolve(dict(headers), dict(body), path_id="from-path")
        winners.append(source)
        assert sid == f"from-{str(source).replace('_', '-')}"
        if source in drop:
            drop[source]()
    assert tuple(winners) == SESSION_ID_SOURCES
    assert winners[:3] == ["dynamo", "claude_code", "codex"]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        # Dynamo's canonical headers -> agent_context.{session_id, parent_session_id, session_final}
        ({"X-Dynamo-Session-ID": "d1"}, ("d1", "dynamo", None, False, ())),
        (
            {"x-dynamo-session-id": "d2", "x-dynamo-parent-session-id": "lead"},
            ("d2", "dynamo", "lead", False, ()),
        ),
        (
            {"X-Dynamo-Session-ID": "d3", "X-Dynamo-Session-Final": "true"},
            ("d3", "dynamo", None, True, ()),
        ),
        (
            {"X-Dynamo-Session-ID": "d4", "X-Dynamo-Session-Final": "false"},
            ("d4", "dynamo", None, False, ()),
        ),
        # Claude Code: a root turn carries its session id only ...
        ({"x-claude-code-session-id": "cc-root"}, ("cc-root", "claude_code", None, False, ())),
        # ... a child agent its agent id under the root session (the parent) ...
        (
            {"x-claude-code-session-id": "cc-root", "x-claude-code-agent-id": "agent-7"},
            ("agent-7", "claude_code", "cc-root", False, ()),
        ),
        # ... a nested child its parent agent.
        (
            {
                "x-claude-code-session-id": "cc-root",
                "x-claude-code-agent-id": "agent-8",
                "x-claude-code-parent-agent-id": "agent-7",
            },
            ("agent-8", "claude_code", "agent-7", False, ()),
        ),
        # An agent id equal to the session id is the root itself.
        (
            {"x-claude-code-session-id": "same", "x-claude-code-agent-id": "same"},
            ("same", "claude_code", None, False, ()),
        ),
        # Codex: session-id (older releases: session_id).
        ({"session-id": "codex-1"}, ("codex-1", "codex", None, False, ())),
        ({"session_id": "codex-2"}, ("codex-2", "codex", None, False, ())),
        # OpenCode: x-session-id (the header source's default) and its parent.
        (
            {"x-session-id": "oc-child", "x-parent-session-id": "oc-lead"},
            ("oc-child", "header", "oc-lead", False, ()),
        ),
        # Dynamo's final header closes a session named by any source.
        (
            {"x-claude-code-session-id": "cc", "X-Dynamo-Session-Final": "1"},
            ("cc", "claude_code", None, True, ()),
        ),
        # Nothing: no identity.
        ({}, (None, None, None, False, ())),
    ],
)
def test_agent_and_dynamo_headers(
    headers: dict[str, str],
    expected: tuple[str | None, str | None, str | None, bool, tuple[str, ...]],
) -> None:
    assert resolve(headers) == expected


def test_opencode_source_reads_its_header_whatever_id_header_says() -> None:
    cfg = dataclasses.replace(ON, id_header="X-My-Session", id_sources=("opencode", "header"))
    assert resolve({"x-session-id": "oc", "x-parent-session-id": "p"}, cfg=cfg) == (
        "oc",
        "opencode",
        "p",
        False,
        (),
    )


def test_dynamo_header_wins_over_agent_headers_and_body() -> None:
    # As in Dynamo: when X-Dynamo-Session-ID is present, it is used, not the agent's.
    sid, src, parent, _, notes = resolve(
        {"X-Dynamo-Session-ID": "d", "x-claude-code-session-id": "cc"}, {"session_id": "b"}
    )
    assert (sid, src, parent) == ("d", "dynamo", None)
    assert notes == (NOTE_CONFLICT,)


# Bad or conflicting identity: each gets one outcome, is noted (counted), loses no request.
@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        # Two sources disagree: the first in the order wins, noted once.
        ({"X-Session-ID": "h"}, {"session_id": "b"}, ("b", "body", None, False, (NOTE_CONFLICT,))),
        (
            {"x-dynamo-session-id": "d", "session-id": "c", "X-Session-ID": "h"},
            {},
            ("d", "dynamo", None, False, (NOTE_CONFLICT,)),
        ),
        # Agreeing sources are no conflict.
        ({"X-Session-ID": "s"}, {"session_id": "s"}, ("s", "body", None, False, ())),
        # A session naming itself as its parent: the link is dropped.
        (
            {"X-Dynamo-Session-ID": "s", "X-Dynamo-Parent-Session-ID": "s"},
            {},
            ("s", "dynamo", None, False, (NOTE_PARENT_SELF,)),
        ),
        # An invalid parent (over the length bound, bad characters): dropped.
        (
            {"X-Dynamo-Session-ID": "s", "X-Dynamo-Parent-Session-ID": LONG},
            {},
            ("s", "dynamo", None, False, (NOTE_PARENT_INVALID,)),
        ),
        (
            {"X-Session-ID": "s", "X-Parent-Session-ID": "bad id"},
            {},
            ("s", "header", None, False, (NOTE_PARENT_INVALID,)),
        ),
        # An agent's or Dynamo's header over the bound: ignored, the next source tried.
        (
            {"X-Dynamo-Session-ID": LONG, "X-Session-ID": "h"},
            {},
            ("h", "header", None, False, (NOTE_REJECTED,)),
        ),
        ({"x-claude-code-session-id": LONG}, {}, (None, None, None, False, (NOTE_REJECTED,))),
        ({"session-id": "bad id"}, {}, (None, None, None, False, (NOTE_REJECTED,))),
        # The deprecated nvext.session_control: still an id source (and close), noted.
        (
            {},
            {"nvext": {"session_control": {"session_id": "n", "action": "close"}}},
            ("n", "nvext", None, True, (NOTE_NVEXT,)),
        ),
        (
            {"X-Session-ID": "h"},
            {"nvext": {"session_control": {"action": "bind"}}},
            ("h", "header", None, False, (NOTE_NVEXT,)),
        ),
    ],
)
def test_bad_or_conflicting_identity(
    headers: dict[str, str],
    body: dict[str, Any],
    expected: tuple[str | None, str | None, str | None, bool, tuple[str, ...]],
) -> None:
    assert resolve(headers, body) == expected


def test_kvproxys_own_sources_still_refuse_an_invalid_id() -> None:
    # The documented 400 of kvproxy's own forms is kept (a client chose that form).
    with pytest.raises(InvalidSessionId, match="at most 128"):
        resolve({"X-Session-ID": LONG})
    with pytest.raises(InvalidSessionId):
        resolve({}, {"session_id": LONG})


def test_notes_travel_with_the_injection_plan() -> None:
    ident = resolve_identity(
        ON,
        path_session_id=None,
        headers={"X-Session-ID": "h", "X-Parent-Session-ID": "h"},
        body={"session_id": "b"},
    )
    plan = injection_plan(ON, ident, {"session_id": "b"})
    assert plan.notes == (NOTE_CONFLICT,)
    assert ident.parent_id is None  # the parent came with the losing source
    # Notes are kept even when the body is not a JSON object.
    assert injection_plan(ON, ident, None).notes == (NOTE_CONFLICT,)


def test_disabled_reads_nothing() -> None:
    off = SessionLifecycleConfig(enabled=False)
    ident = resolve_identity(
        off, path_session_id=None, headers={"X-Dynamo-Session-ID": LONG}, body={}
    )
    assert ident.session_id is None and ident.notes == ()
