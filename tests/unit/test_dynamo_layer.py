"""The Dynamo layer (kvproxy.proxy.dynamo_layer) as playbooks: no sockets, no engines.

Each test plans a real request (:func:`kvproxy.proxy.pipeline.plan_request`), runs it
through the layer over a real :class:`~kvproxy.dynamo.control.Dynamo` whose engine
calls go to a recording HTTP fake, with a recording transport that answers what the
test scripts (a 200 or not, a translated answer), and reads back every effect in
order. The real transports are tested against real engines elsewhere (the handlers
in tests/integration/test_dynamo_e2e.py, the lab in tests/lab/test_lab_dynamo.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest

from kvproxy.config import from_mapping
from kvproxy.dynamo import control as dynamo
from kvproxy.dynamo import streaming as st
from kvproxy.dynamo.control import Dynamo, Translated
from kvproxy.dynamo.prefill import StreamAnswer
from kvproxy.fleet.ring import HashRing
from kvproxy.proxy.dynamo_layer import DynamoLayer
from kvproxy.proxy.pipeline import Plan, Refusal, plan_request
from kvproxy.proxy.relaying import Keep
from kvproxy.sessions.identity import ROUTING_KEY_HEADER

W1, W2 = "http://127.0.0.1:1", "http://127.0.0.1:2"
ROUTER = "http://router:9"
IDS = [5, 6, 7, 8]
ANSWER = {"output_ids": [9, 10], "meta_info": {"prompt_tokens": 4, "completion_tokens": 2}}


class _Resp:
    def __init__(self, status: int, text: str = "") -> None:
        self.status = status
        self._text = text

    async def __aenter__(self) -> _Resp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        return self._text.encode()

    async def text(self, encoding: str | None = None, errors: str = "strict") -> str:
        return self._text

    def raise_for_status(self) -> None:
        return None


@dataclass
class FakeHttp:
    """Dynamo's engine calls: recorded, answered 200 unless scripted otherwise."""

    log: list[tuple[Any, ...]]
    open_status: int = 200

    def post(
        self,
        url: str,
        *,
        data: Any = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> _Resp:
        doc = json if json is not None else orjson.loads(data)
        self.log.append(("engine", url, doc.get("session_id") or doc.get("rid")))
        if url.endswith("/open_session"):
            return _Resp(self.open_status, "" if self.open_status == 200 else "refused")
        return _Resp(200)

    def get(self, url: str, *, timeout: aiohttp.ClientTimeout | None = None) -> _Resp:
        raise aiohttp.ClientConnectionError(url)  # capacity unknown: no pool-share bound


@dataclass
class Script:
    status: int = 200  # what the ordinary request answers
    keep: str = "body"  # how a 200's answer reaches `keep`: body, stream, or none
    translated: Translated[str] | None = None  # what the relay produced
    relay_raises: BaseException | None = None


@dataclass
class Transport:
    """The layer's transport, recording every effect."""

    pb: Playbook

    def received(self, req: str) -> tuple[str, Mapping[str, str]]:
        return self.pb.path, self.pb.headers

    def entered(self, req: str, plan: Plan, tracked: object | None) -> None:
        self.pb.log.append(("entered",))

    def decided(self, req: str, decision: Any, observe: Any) -> None:
        self.pb.log.append(("decided",))

    async def forward(
        self,
        req: str,
        plan: Plan,
        fields: Mapping[str, Any],
        source: str | None,
        keep: Keep | None,
    ) -> str:
        self.pb.log.append(("forward", keep is not None))
        script = self.pb.script
        if keep is not None and script.status == 200:
            if script.keep == "body":
                keep.body(orjson.dumps(ANSWER))
            elif script.keep == "stream":
                answer = StreamAnswer(self.pb.path, on_done=keep.stream)
                answer.feed(b"data: " + orjson.dumps({**ANSWER, "text": "ok"}) + b"\n\n")
                answer.feed(b"data: [DONE]\n\n")
        return f"ordinary {script.status}"

    def answered(self, response: str) -> bool:
        return response.endswith("200")

    def sent_headers(self, req: str, plan: Plan) -> Mapping[str, str]:
        return {**self.pb.headers, **plan.headers}

    async def relay(
        self, req: str, out: bytes, headers: Mapping[str, str], streamed: bool, sid: str
    ) -> Translated[str]:
        doc = orjson.loads(out)
        assert doc["session_params"] == {"id": sid}
        self.pb.log.append(("relay", doc["input_ids"], doc["session_params"], streamed))
        if self.pb.script.relay_raises is not None:
            raise self.pb.script.relay_raises
        assert self.pb.script.translated is not None
        return self.pb.script.translated

    def observe_tail(self, req: str, tail: bytes) -> None:
        self.pb.log.append(("observe_tail", tail))


@dataclass
class Playbook:
    config: dict[str, Any] = field(default_factory=dict)
    script: Script = field(default_factory=Script)
    path: str = "/generate"
    headers: dict[str, str] = field(default_factory=lambda: {"X-Session-ID": "s"})
    log: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = from_mapping(
            {
                "router": {"policy": "consistent_hashing"},
                "session_lifecycle": {"enabled": True, **self.config},
            }
        )
        self.cfg = cfg
        self.http = FakeHttp(self.log)
        self.dynamo = Dynamo(
            cfg,
            http=self.http,
            router_base=ROUTER,
            ring_workers=lambda: ((W1, W2), (W1, W2)),
            close_session=self._closed,
            session_open=lambda sid: True,
            pressure=lambda engine: False,
        )
        self.layer: DynamoLayer[str, str, object] = DynamoLayer(self.dynamo, self, Transport(self))

    async def _closed(self, sid: str) -> None:
        self.log.append(("bind_closed", sid))

    def plan(self, body: dict[str, Any]) -> Plan:
        plan = plan_request(self.cfg, self.path, None, self.headers, body)
        assert not isinstance(plan, Refusal)
        return plan

    async def turn(self, body: dict[str, Any]) -> Any:
        """One turn: begin, send, end; the background engine calls awaited."""
        plan = self.plan(body)
        assert plan.session_id is not None
        turn, plan = self.layer.begin_turn("req", plan, plan.session_id)
        try:
            return await self.layer.send("req", plan, turn, plan.fields, None)
        finally:
            if turn is not None:
                self.layer.end_turn(turn)
            pending = self.dynamo._background | self.dynamo._prefills
            await asyncio.gather(*pending, return_exceptions=True)

    def effects(self) -> list[str]:
        return [e[0] for e in self.log]

    def count(self, name: str) -> float:
        return self.dynamo.counters.total(name)


def _gen(nvext: dict[str, Any] | None = None, ids: list[int] = IDS, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, **extra}
    if nvext is not None:
        body["nvext"] = nvext
    return body


OPEN = {"session_control": {"session_id": "s", "action": "open"}}
PREFILL = {"agent_hints": {"speculative_prefill": True}}
OWNER = HashRing((W1, W2)).owner("s", {W1, W2})


async def test_a_quiet_turn_opens_nothing_and_forwards_as_planned() -> None:
    pb = Playbook()
    plan = pb.plan(_gen())
    turn, planned = pb.layer.begin_turn("req", plan, "s")
    assert turn is None and planned is plan  # no admission: nothing to fold in
    assert await pb.turn(_gen()) == "ordinary 200"
    assert pb.log == [("forward", False)]


async def test_bind_routes_stickily_and_its_timer_runs_between_turns() -> None:
    pb = Playbook()
    bind = {"session_control": {"session_id": "s", "action": "bind", "timeout": 5}}
    plan = pb.plan(_gen(bind))
    turn, planned = pb.layer.begin_turn("req", plan, "s")
    assert turn is not None and planned.headers[ROUTING_KEY_HEADER] == "s"
    assert pb.dynamo.timers.timeout_of("s") == 5.0
    pb.layer.end_turn(turn)
    # A client's own routing key wins over the sticky one.
    pb.headers[ROUTING_KEY_HEADER] = "mine"
    _, planned = pb.layer.begin_turn("req", pb.plan(_gen()), "s")
    assert ROUTING_KEY_HEADER not in planned.headers


@pytest.mark.parametrize("keep", ["body", "stream"])
async def test_a_prefill_turn_keeps_its_answer_and_prefills_once(keep: str) -> None:
    pb = Playbook(script=Script(keep=keep))
    assert await pb.turn(_gen(PREFILL)) == "ordinary 200"
    prefills = [e for e in pb.log if e[0] == "engine" and e[1] == ROUTER + "/generate"]
    assert pb.log[0] == ("forward", True) and len(prefills) == 1
    assert pb.count(dynamo.PREFILL_SENT) == 1


async def test_a_failed_answer_starts_no_prefill() -> None:
    pb = Playbook(script=Script(status=502))
    assert await pb.turn(_gen(PREFILL)) == "ordinary 502"
    assert pb.log == [("forward", True)]
    counted = dict(pb.dynamo.counters.window_items())
    assert not any(n for k, n in counted.items() if k.startswith(dynamo.PREFILL_SKIPPED))
    assert pb.count(dynamo.PREFILL_SENT) == 0


async def test_prefill_off_keeps_nothing() -> None:
    pb = Playbook(config={"speculative_prefill": False})
    await pb.turn(_gen(PREFILL))
    assert pb.log == [("forward", False)]


def _served(body: bytes | None = None, complete: bool = True) -> Translated[str]:
    return Translated("translated", complete, [9, 10], 4, False, body, b"tail")


async def test_open_claims_a_slot_relays_the_turn_and_keeps_the_context() -> None:
    pb = Playbook(script=Script(translated=_served(orjson.dumps(ANSWER))))
    assert await pb.turn(_gen(OPEN)) == "translated"
    assert pb.log == [
        ("engine", OWNER + "/open_session", "s"),
        ("relay", IDS, {"id": "s"}, False),
        ("observe_tail", b"tail"),
    ]
    slot = pb.dynamo.slots.get("s")
    assert slot is not None and slot.context == (*IDS, 9, 10) and not slot.in_flight
    assert pb.count(dynamo.STREAM_OPENED) == 1


async def test_extend_sends_only_the_new_tokens() -> None:
    pb = Playbook(script=Script(translated=_served(orjson.dumps(ANSWER))))
    await pb.turn(_gen(OPEN))
    pb.log.clear()
    pb.script.translated = Translated("again", True, [12], 7, False, b"{}", b"")
    bind = {"session_control": {"session_id": "s", "action": "bind"}}
    assert await pb.turn(_gen(bind, [*IDS, 9, 10, 11])) == "again"
    assert pb.log == [("relay", [11], {"id": "s"}, False), ("observe_tail", b"")]
    assert pb.count(dynamo.STREAM_EXTENDED) == 1


async def test_a_relay_that_failed_first_closes_the_slot_then_sends_the_ordinary_request() -> None:
    pb = Playbook(script=Script(translated=Translated(None)))
    assert await pb.turn(_gen(OPEN)) == "ordinary 200"
    assert pb.effects() == ["engine", "relay", "engine", "forward"]
    assert pb.log[2] == ("engine", OWNER + "/close_session", "s")  # awaited before it
    assert pb.dynamo.slots.get("s") is None
    assert pb.count(dynamo.STREAM_FALLBACK + st.R_ENGINE_ERROR) == 1


async def test_a_stream_broken_midway_is_answered_and_the_slot_given_up() -> None:
    pb = Playbook(script=Script(translated=_served(None, complete=False)))
    assert await pb.turn(_gen({**OPEN}, stream=True)) == "translated"
    assert pb.effects() == ["engine", "relay", "engine"]  # no usage read, no forward
    assert pb.log[1][3] is True and pb.dynamo.slots.get("s") is None


async def test_a_client_gone_mid_stream_gives_the_slot_up() -> None:
    pb = Playbook(script=Script(relay_raises=asyncio.CancelledError()))
    with pytest.raises(asyncio.CancelledError):
        await pb.turn(_gen(OPEN, stream=True))
    assert pb.dynamo.slots.get("s") is None
    assert pb.count(dynamo.STREAM_FALLBACK + st.R_ENGINE_ERROR) == 1


async def test_a_client_gone_after_the_answers_done_records_the_turn_once() -> None:
    # Cancelled once the answer's [DONE] was relayed (the upstream holding the stream
    # open): the answer is complete, its usage read and its context kept, once; the
    # cancellation goes on.
    done = dynamo.AnsweredThenCancelled(_served())
    pb = Playbook(script=Script(relay_raises=done))
    with pytest.raises(asyncio.CancelledError):
        await pb.turn(_gen(OPEN, stream=True))
    assert pb.effects() == ["engine", "relay", "observe_tail"]  # no close, no forward
    slot = pb.dynamo.slots.get("s")
    assert slot is not None and slot.context == (*IDS, 9, 10) and not slot.in_flight
    assert pb.count(dynamo.STREAM_FALLBACK + st.R_ENGINE_ERROR) == 0


async def test_a_context_mismatch_falls_back_to_the_ordinary_request() -> None:
    wrong = Translated("translated", True, [9], 99, False, b"{}", b"tail")
    pb = Playbook(script=Script(translated=wrong))
    assert await pb.turn(_gen(OPEN)) == "ordinary 200"
    assert "observe_tail" not in pb.effects()  # the ordinary request reports the usage
    assert pb.effects()[-1] == "forward" and pb.dynamo.slots.get("s") is None
    assert pb.count(dynamo.STREAM_FALLBACK + st.R_CONTEXT_CHECK) == 1


async def test_an_engine_that_refuses_to_open_gets_the_ordinary_request() -> None:
    pb = Playbook()
    pb.http.open_status = 400
    assert await pb.turn(_gen(OPEN)) == "ordinary 200"
    assert pb.effects() == ["engine", "forward"]  # no relay
    assert pb.count(dynamo.STREAM_FALLBACK + st.R_OPEN_FAILED) == 1


async def test_chat_open_behaves_as_bind() -> None:
    pb = Playbook(path="/v1/chat/completions")
    body = {"messages": [{"role": "user", "content": "hi"}], "nvext": OPEN}
    assert await pb.turn(body) == "ordinary 200"
    assert pb.log == [("forward", False)] and len(pb.dynamo.slots) == 0
