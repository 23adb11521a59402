"""Session identity as agents send it, end to end: kvproxy -> the real router (smg) ->
simulated engines. Every header form reaches the engine as the right top-level
``session_id``; Dynamo's final header closes the session on every engine; each recipe
of docs/adoption.md works with the exact headers its harness sends; parent links show
in ``/kvproxy/sessions`` (behind the admin token)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import orjson
import pytest

from kvproxy.keys import SESSIONS
from kvproxy.sessions import lifecycle_metrics as m
from tests.helpers import new_marker

from .conftest import MakeProxy, Proxy, recorded, wait_until

pytestmark = pytest.mark.usefixtures("router")

MODEL = "kvproxy/sim-model"
TOKEN = "ident-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


async def _chat(
    http: aiohttp.ClientSession, proxy: Proxy, headers: dict[str, str], marker: str
) -> dict[str, Any]:
    """One chat turn as an OpenAI-compatible client sends it; the engine's body."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"turn {marker}"}],
        "max_tokens": 2,
        "stream": False,
    }
    async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
    return await _engine_body(http, marker)


async def _engine_body(http: aiohttp.ClientSession, marker: str) -> dict[str, Any]:
    engines = _ENGINES[0]
    (entry,) = [
        r for r in await recorded(http, engines, path="/v1/chat/completions") if marker in r["body"]
    ]
    return dict(orjson.loads(entry["body"]))


_ENGINES: list[list[str]] = []


@pytest.fixture(autouse=True)
def _engines(engine_urls: list[str]) -> None:
    _ENGINES[:] = [engine_urls]


async def _closed_on_every_engine(
    http: aiohttp.ClientSession, engine_urls: list[str], sid: str, timeout_s: float = 5.0
) -> None:
    async def closed() -> bool:
        for url in engine_urls:
            got = [
                r
                for r in await recorded(http, [url], path="/close_session")
                if orjson.loads(r["body"]).get("session_id") == sid
            ]
            if not got:
                return False
        return True

    await wait_until(closed, timeout_s=timeout_s, what=f"{sid} closed on every engine")


async def _closes(http: aiohttp.ClientSession, engine_urls: list[str], sid: str) -> int:
    return sum(
        1
        for r in await recorded(http, engine_urls, path="/close_session")
        if orjson.loads(r["body"]).get("session_id") == sid
    )


# The exact identity headers each harness sends (docs/adoption.md), the session the
# engine must see, and the parent kvproxy must record.
def _forms() -> list[tuple[str, dict[str, str], str, str | None]]:
    root, agent, parent = _id("root"), _id("agent"), _id("lead")
    dyn, codex, oc, custom = _id("dyn"), _id("codex"), _id("oc"), _id("custom")
    return [
        ("dynamo", {"X-Dynamo-Session-ID": dyn}, dyn, None),
        (
            "dynamo-child",
            {"X-Dynamo-Session-ID": dyn + "-c", "X-Dynamo-Parent-Session-ID": dyn},
            dyn + "-c",
            dyn,
        ),
        ("claude-code-root", {"x-claude-code-session-id": root}, root, None),
        (
            "claude-code-child",
            {"x-claude-code-session-id": root, "x-claude-code-agent-id": agent},
            agent,
            root,
        ),
        (
            "claude-code-nested",
            {
                "x-claude-code-session-id": root,
                "x-claude-code-agent-id": agent + "-n",
                "x-claude-code-parent-agent-id": agent,
            },
            agent + "-n",
            agent,
        ),
        ("codex", {"session-id": codex}, codex, None),
        ("opencode", {"x-session-id": oc + "-c", "x-parent-session-id": parent}, oc + "-c", parent),
        ("openai-sdk", {"X-Session-ID": custom}, custom, None),
    ]


async def test_every_header_form_reaches_the_engine_as_top_level_session_id(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    for name, headers, sid, parent in _forms():
        marker = new_marker()
        got = await _chat(http, proxy, headers, marker)
        assert got["session_id"] == sid, name
        # Only the session id and a rid were added; the agent's headers are forwarded.
        assert "parent_session_id" not in got, name
        table = proxy.app[SESSIONS]._table
        assert table.parent(sid) == parent, name
    assert proxy.app[SESSIONS].stats()[m.PARENT_LINKED] == 4.0


async def test_dynamo_final_header_closes_the_session_on_every_engine(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _id("final")
    for final in ("false", "true"):
        got = await _chat(
            http,
            proxy,
            {"X-Dynamo-Session-ID": sid, "X-Dynamo-Session-Final": final},
            new_marker(),
        )
        assert got["session_id"] == sid
        if final == "false":
            assert await _closes(http, engine_urls, sid) == 0
    await _closed_on_every_engine(http, engine_urls, sid)
    assert proxy.app[SESSIONS].state(sid) == "closed"
    assert proxy.app[SESSIONS].stats()[m.CLOSED_FINAL] == 1.0


async def test_bad_or_conflicting_agent_identity_loses_no_request(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _id("ok")
    cases: list[tuple[dict[str, str], str | None]] = [
        ({"X-Dynamo-Session-ID": "x" * 200}, None),  # over the bound: ignored
        ({"x-claude-code-session-id": "has space", "X-Session-ID": sid}, sid),  # next source
        ({"X-Dynamo-Session-ID": sid, "X-Session-ID": _id("other")}, sid),  # conflict
        ({"X-Dynamo-Session-ID": sid, "X-Dynamo-Parent-Session-ID": sid}, sid),  # self
    ]
    for headers, expected in cases:
        got = await _chat(http, proxy, headers, new_marker())
        assert got.get("session_id") == expected, headers
    stats = proxy.app[SESSIONS].stats()
    assert stats[m.ID_REJECTED] == 2.0
    assert stats[m.ID_CONFLICT] == 1.0 and stats[m.PARENT_SELF] == 1.0
    assert proxy.app[SESSIONS]._table.parent(sid) is None


async def test_deprecated_session_control_still_works_and_is_counted(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid, marker = _id("nv"), new_marker()
    body = {
        "model": MODEL,
        "prompt": f"nvext {marker}",
        "max_tokens": 2,
        "nvext": {"session_control": {"session_id": sid}},
    }
    async with http.post(proxy.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
    async with http.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    assert "agentic_kv_session_nvext_session_control_total 1.0" in text
    async with http.get(proxy.url + "/kvproxy/stats") as resp:
        stats = await resp.json()
    assert stats["agentic_kv/session/nvext_session_control"] == 1.0


# ------------------------------------------------------------------ the recipes
# docs/adoption.md: what each harness sends and how its session ends.


async def test_recipe_claude_code_children_close_with_their_lead_or_by_idle_timeout(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    # Claude Code sends no final signal: its sessions end by the idle timeout, and with
    # close_children a lead's close (the idle timeout's, or an explicit one) ends its
    # subagents that never closed.
    proxy = await make_proxy(
        session_lifecycle={"enabled": True, "idle_timeout_s": 0.5, "close_children": True}
    )
    root, agents = _id("cc"), [_id("cc-agent") for _ in range(2)]
    base = {"x-claude-code-session-id": root, "anthropic-version": "2023-06-01"}
    await _chat(http, proxy, base, new_marker())
    # Two subagents at once, under the root session.
    bodies = await asyncio.gather(
        *(_chat(http, proxy, {**base, "x-claude-code-agent-id": a}, new_marker()) for a in agents)
    )
    assert sorted(b["session_id"] for b in bodies) == sorted(agents)
    assert proxy.app[SESSIONS]._table.children(root) == frozenset(agents)
    for sid in (root, *agents):
        await _closed_on_every_engine(http, engine_urls, sid)
    for sid in (root, *agents):
        assert await _closes(http, engine_urls, sid) == len(engine_urls)  # once each


async def test_recipe_codex_one_id_shared_by_concurrent_turns_closes_once(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    # Codex (and Claude Code without agent ids) shares one id across its subagents:
    # several turns of one session in flight at once; the session is explicit-closed.
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _id("codex")
    headers = {"session-id": sid, "originator": "codex_cli_rs"}
    bodies = await asyncio.gather(*(_chat(http, proxy, headers, new_marker()) for _ in range(4)))
    assert {b["session_id"] for b in bodies} == {sid}
    stats = proxy.app[SESSIONS].stats()
    assert stats[m.STARTED] == 1.0 and stats[m.OPEN] == 1.0
    async with http.post(proxy.url + "/close_session", json={"session_id": sid}) as resp:
        assert resp.status == 200
    await _closed_on_every_engine(http, engine_urls, sid)


async def test_recipe_opencode_and_openai_sdk_and_custom_client_end_as_documented(
    make_proxy: MakeProxy, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    # OpenCode: each subtask its own id, naming its parent; ended by an explicit close
    # (or the idle timeout).
    lead, child = _id("oc-lead"), _id("oc-child")
    await _chat(http, proxy, {"x-session-id": lead}, new_marker())
    got = await _chat(
        http, proxy, {"x-session-id": child, "x-parent-session-id": lead}, new_marker()
    )
    assert got["session_id"] == child
    async with http.post(proxy.url + f"/kvproxy/sessions/{child}/close") as resp:
        assert resp.status == 200
    await _closed_on_every_engine(http, engine_urls, child)
    assert proxy.app[SESSIONS].state(lead) == "open"  # close_children is off
    # The OpenAI SDK: extra_headers X-Session-ID, X-Session-Final on the last turn.
    sdk = _id("sdk")
    for final in ({}, {"X-Session-Final": "true"}):
        got = await _chat(http, proxy, {"X-Session-ID": sdk, **final}, new_marker())
        assert got["session_id"] == sdk
    await _closed_on_every_engine(http, engine_urls, sdk)
    # A custom client: Dynamo's canonical headers, X-Dynamo-Session-Final on the last turn.
    custom, parent = _id("custom"), _id("custom-lead")
    headers = {"X-Dynamo-Session-ID": custom, "X-Dynamo-Parent-Session-ID": parent}
    await _chat(http, proxy, headers, new_marker())
    await _chat(http, proxy, {**headers, "X-Dynamo-Session-Final": "true"}, new_marker())
    await _closed_on_every_engine(http, engine_urls, custom)


# ------------------------------------------------------------ /kvproxy/sessions


async def test_sessions_listing_shows_the_tree_behind_the_admin_token(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(server={"admin_token": TOKEN}, session_lifecycle={"enabled": True})
    lead, kids = _id("lead"), [_id("kid") for _ in range(3)]
    await _chat(http, proxy, {"X-Dynamo-Session-ID": lead}, new_marker())
    for kid in kids:
        await _chat(
            http,
            proxy,
            {"X-Dynamo-Session-ID": kid, "X-Dynamo-Parent-Session-ID": lead},
            new_marker(),
        )
    async with http.get(proxy.url + "/kvproxy/sessions") as resp:
        assert resp.status == 401
    rows: list[dict[str, Any]] = []
    after: str | None = None
    for _ in range(10):  # bounded: 4 sessions, pages of 2
        query = "?limit=2" + (f"&after={after}" if after else "")
        async with http.get(proxy.url + "/kvproxy/sessions" + query, headers=BEARER) as resp:
            assert resp.status == 200
            page = await resp.json()
        assert len(page["sessions"]) <= 2
        rows.extend(page["sessions"])
        after = page["next"]
        if after is None:
            break
    by_id = {r["session_id"]: r for r in rows}
    assert set(by_id) == {lead, *kids}
    assert by_id[lead]["children"] == sorted(kids) and by_id[lead]["parent"] is None
    assert all(by_id[k]["parent"] == lead for k in kids)
    async with http.get(proxy.url + "/kvproxy/sessions?limit=0", headers=BEARER) as resp:
        assert resp.status == 400
    # The dashboard's data carries the tree too.
    async with http.get(proxy.url + "/kvproxy/dashboard/data", headers=BEARER) as resp:
        doc = await resp.json()
    (tree,) = doc["session_tree"]
    assert tree["session_id"] == lead
    assert sorted(c["session_id"] for c in tree["child_rows"]) == sorted(kids)


# ------------------------------------------------------------- /v1/responses


async def test_responses_api_is_forwarded_unchanged_as_smg_refuses_session_id_there(
    make_proxy: MakeProxy, router: Any, http: aiohttp.ClientSession, engine_urls: list[str]
) -> None:
    # SGLang's ResponsesRequest takes a top-level session_id (#29436), but smg (1.13)
    # refuses it on /v1/responses (unknown field): kvproxy must not inject it there.
    marker = new_marker()
    body = {"model": MODEL, "input": f"resp {marker}", "max_output_tokens": 2}
    async with http.post(router.url + "/v1/responses", json={**body, "session_id": "s"}) as resp:
        assert resp.status == 400 and "session_id" in await resp.text()
    proxy = await make_proxy(session_lifecycle={"enabled": True})
    sid = _id("resp")
    async with http.post(
        proxy.url + "/v1/responses", json=body, headers={"X-Dynamo-Session-ID": sid}
    ) as resp:
        assert resp.status == 200, await resp.text()
        doc = await resp.json()
    assert doc["object"] == "response"
    (entry,) = [
        r for r in await recorded(http, engine_urls, path="/v1/responses") if marker in r["body"]
    ]
    assert "session_id" not in orjson.loads(entry["body"])
    assert proxy.app[SESSIONS].state(sid) is None  # not tracked: forwarded as received
