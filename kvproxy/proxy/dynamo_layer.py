"""The Dynamo turn as a layer of the request path: its decisions written once, no I/O.

:class:`DynamoLayer` is the :class:`~kvproxy.proxy.turn.TurnShell` that
:class:`~kvproxy.proxy.turn.TurnFlow` carries a planned request through. It decides
what Dynamo (``nvext`` session control and agent hints, docs/dynamo.md) does with a
turn and leaves every effect that touches a socket or an engine to the
:class:`Transport` below it: the proxy's handlers over aiohttp
(:class:`~kvproxy.proxy.handlers.ProxyHandlers`) or the in-process lab
(``kvlab.lab.proxy.LabProxy``). Dynamo's own state (bind timers, streaming slots,
counters, engine control calls) is :class:`~kvproxy.dynamo.control.Dynamo`. A test
drives the layer with a recording transport (tests/unit/test_dynamo_layer.py).

A turn, in order:

1. ``begin_turn``: nothing to do when Dynamo is quiet for the session (no ``nvext``,
   no slot, no bind timer: the common case); else :meth:`Dynamo.begin` (the bind
   timer, the sticky routing header); the plan gets those headers and admission's
   routing key (:func:`~kvproxy.proxy.pipeline.with_turn_headers`);
2. ``send``: the priority's source is counted; a turn Dynamo is not involved in and
   that keeps no answer goes to ``transport.forward`` as it is. Otherwise:

   a. when Dynamo is involved (a streaming slot exists, or an ``open``): the body must
      be JSON; Dynamo plans the route; an ``open`` / ``extend`` claims the slot and the
      transport relays the turn in streaming-session form (``transport.relay``); what
      it produced is recorded (:meth:`Dynamo.finish_turn`, or the slot given up), and
      a served turn starts its speculative prefill (a streamed one whose client hung
      up after its ``[DONE]`` too: it is complete). Not served: :meth:`Dynamo.settle`
      (a refused slot's close awaited, idle slots released);
   b. the ordinary request, through ``transport.forward``, its answer kept when a
      speculative prefill is asked for (:class:`KeepAnswer`); a 200 whose streamed
      answer did not already start it starts the prefill;
3. ``end_turn``: :meth:`Dynamo.end` (the bind timer's turn is over).

``entered`` and ``decided`` (the turn's tracking and admission's decision) go to the
transport unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from kvproxy.admission.records import Decision
from kvproxy.config import Config
from kvproxy.dynamo import streaming as st
from kvproxy.dynamo.control import AnsweredThenCancelled, Dynamo, Translated, Turn
from kvproxy.dynamo.prefill import StreamAnswer
from kvproxy.proxy.pipeline import Plan, with_turn_headers
from kvproxy.proxy.relaying import Keep
from kvproxy.proxy.scan import validated
from kvproxy.proxy.turn import ObserveUsage, Tracked, TurnAdmission, TurnFlow, TurnSessions
from kvproxy.sessions.identity import ROUTING_KEY_HEADER

log = logging.getLogger(__name__)

R = TypeVar("R")  # the transport's request
S = TypeVar("S")  # what sending answers (the transport's response)
K = TypeVar("K")  # a tracked request (kvproxy.proxy.turn.Tracked)
KT = TypeVar("KT", bound=Tracked)
_R = TypeVar("_R", contravariant=True)
_S = TypeVar("_S")
_K = TypeVar("_K", contravariant=True)

_NO_HEADERS: Mapping[str, str] = {}  # shared, never written


class Configured(Protocol):
    """Where the running config is read (:class:`~kvproxy.config.LiveConfig`)."""

    @property
    def config(self) -> Config: ...


class Transport(Protocol[_R, _S, _K]):
    """What the layer asks of the shell below it (every effect with I/O)."""

    def received(self, req: _R) -> tuple[str, Mapping[str, str]]:
        """The path the request was received on, and its headers."""
        ...

    def entered(self, req: _R, plan: Plan, tracked: _K | None) -> None:
        """:meth:`kvproxy.proxy.turn.TurnShell.entered`, unchanged."""
        ...

    def decided(self, req: _R, decision: Decision, observe: ObserveUsage | None) -> None:
        """:meth:`kvproxy.proxy.turn.TurnShell.decided`, unchanged."""
        ...

    def forward(
        self,
        req: _R,
        plan: Plan,
        fields: Mapping[str, Any],
        source: str | None,
        keep: Keep | None,
    ) -> Awaitable[_S]:
        """Send the ordinary request (the planned body with ``fields``; ``source``: the
        added priority's) and answer its response; a 200's answer goes to ``keep``."""
        ...

    def answered(self, response: _S) -> bool:
        """Whether ``response`` is a 200."""
        ...

    def sent_headers(self, req: _R, plan: Plan) -> Mapping[str, str]:
        """The request headers forwarded for ``plan`` (what a prefill copies)."""
        ...

    def relay(
        self, req: _R, out: bytes, headers: Mapping[str, str], streamed: bool, sid: str
    ) -> Awaitable[Translated[_S]]:
        """Send ``out``, a turn of session ``sid`` in streaming-session form, to the
        router's ``/generate`` with ``headers``; relay its answer unless it failed before
        anything reached the client (``streamed``: an event stream is asked for)."""
        ...

    def observe_tail(self, req: _R, tail: bytes) -> None:
        """A translated answer's last bytes: the engine's usage report, for admission."""
        ...


class DynamoLayer(Generic[R, S, K]):
    """The Dynamo turn's decisions over one :class:`Dynamo` and one transport."""

    __slots__ = ("dynamo", "live", "transport")

    def __init__(self, dynamo: Dynamo, live: Configured, transport: Transport[R, S, K]) -> None:
        self.dynamo = dynamo
        self.live = live
        self.transport = transport

    # -- kvproxy.proxy.turn.TurnShell -------------------------------------------------
    def begin_turn(self, req: R, plan: Plan, session_id: str) -> tuple[Turn | None, Plan]:
        """The session's Dynamo turn (None when it would do nothing), and the plan with
        the turn's routing headers and program admission's routing key folded in."""
        turn: Turn | None = None
        turn_headers: Mapping[str, str] = _NO_HEADERS
        quiet = self.dynamo.quiet(session_id, plan.nvext)
        if quiet and not plan.admit:
            return None, plan  # no headers to fold in, no routing key to derive
        path, headers = self.transport.received(req)
        if not quiet:
            turn, turn_headers = self.dynamo.begin(session_id, path, plan.nvext, plan.close_after)
        return turn, with_turn_headers(plan, self.live.config, headers, turn_headers)

    def end_turn(self, turn: Turn) -> None:
        self.dynamo.end(turn)

    def entered(self, req: R, plan: Plan, tracked: K | None) -> None:
        self.transport.entered(req, plan, tracked)

    def decided(self, req: R, decision: Decision, observe: ObserveUsage | None) -> None:
        self.transport.decided(req, decision, observe)

    def send(
        self,
        req: R,
        plan: Plan,
        turn: Turn | None,
        fields: Mapping[str, Any],
        source: str | None,
    ) -> Awaitable[S]:
        """The planned request, forwarded (or served as a Dynamo turn). A plain function
        returning the forward's coroutine on the common path: one coroutine fewer."""
        if source is not None and self.live.config.session_lifecycle.enabled:
            self.dynamo.note_priority(source)
        if turn is not None and (self.dynamo.involved(turn) or turn.wants_body):
            return self._send_turn(req, plan, turn, fields, source)
        return self.transport.forward(req, plan, fields, source, None)

    # -- a turn Dynamo is involved in, or that keeps its answer ---------------------
    async def _send_turn(
        self, req: R, plan: Plan, turn: Turn, fields: Mapping[str, Any], source: str | None
    ) -> S:
        if self.dynamo.involved(turn):
            # Dynamo relays it from the plan's body and fields (the bytes rendered for
            # the ordinary request are not sent then).
            served = await self._serve_turn(req, plan, turn, fields)
            if served is not None:
                return served
        keep = KeepAnswer(self, req, plan, turn) if turn.wants_body else None
        response = await self.transport.forward(req, plan, fields, source, keep)
        if keep is not None and self.transport.answered(response) and not turn.answered:
            self.prefill(req, plan, turn)
        return response

    async def _serve_turn(
        self, req: R, plan: Plan, turn: Turn, fields: Mapping[str, Any]
    ) -> S | None:
        """A streaming-session turn (open / extend), relayed in that form; None: the
        ordinary request follows (a refused slot closed first, idle slots on its
        engine released until it fits)."""
        body = plan.body
        assert body is not None
        dynamo = self.dynamo
        headers = self.transport.received(req)[1]
        key = headers.get(ROUTING_KEY_HEADER) or plan.headers.get(
            ROUTING_KEY_HEADER, turn.session_id
        )
        if not validated(body):
            return None  # a deferred token array is not JSON: the engine answers 400
        route = dynamo.plan(turn, body, key)
        if route.kind in (st.OPEN, st.EXTEND):
            served = await self._translated(req, plan, turn, body, fields)
            if served is not None:
                return served
        await dynamo.settle(turn, body, key)
        return None

    async def _translated(
        self,
        req: R,
        plan: Plan,
        turn: Turn,
        body: Mapping[str, Any],
        fields: Mapping[str, Any],
    ) -> S | None:
        """The turn sent in streaming-session form; None: nothing reached the client."""
        dynamo, transport = self.dynamo, self.transport
        slot = await dynamo.claim_slot(turn, body)
        if slot is None:
            return None
        out = dynamo.translated_body(turn, body, dict(fields))
        headers = transport.sent_headers(req, plan)
        streamed = bool(body.get("stream"))
        try:
            answer = await transport.relay(req, out, headers, streamed, turn.session_id)
        except AnsweredThenCancelled as done:
            # The client hung up once it had read the answer's [DONE]: the turn is
            # complete, recorded as one; the handler's cancellation goes on.
            self._streamed(req, turn, slot, body, headers, done.answer)
            raise
        except asyncio.CancelledError:
            if streamed:  # a client gone mid-stream: the slot is given up
                dynamo.give_up(slot, st.R_ENGINE_ERROR)
            raise
        if answer.response is None:  # failed before anything reached the client
            await dynamo.give_up_first(slot, st.R_ENGINE_ERROR)
            return None
        if not answer.complete:  # broke off mid-stream: the session stops streaming
            dynamo.give_up(slot, st.R_ENGINE_ERROR)
            return answer.response
        if answer.body is None:  # an event stream, relayed already
            self._streamed(req, turn, slot, body, headers, answer)
            return answer.response
        if not dynamo.finish_turn(
            turn, slot, body["input_ids"], answer.output_ids, answer.prompt_tokens, False
        ):
            return None
        transport.observe_tail(req, answer.tail)
        turn.response = answer.body
        dynamo.after_response(turn, body, headers)  # the speculative prefill
        return answer.response

    def _streamed(
        self,
        req: R,
        turn: Turn,
        slot: st.Slot,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        answer: Translated[Any],
    ) -> None:
        """A streamed turn relayed through its ``[DONE]``: its usage to admission, what
        it produced to the slot, then its speculative prefill."""
        self.transport.observe_tail(req, answer.tail)
        self.dynamo.finish_turn(
            turn, slot, body["input_ids"], answer.output_ids, answer.prompt_tokens, answer.aborted
        )
        self.dynamo.after_response(turn, body, headers)  # the speculative prefill

    def prefill(self, req: R, plan: Plan, turn: Turn) -> None:
        """The turn's speculative prefill, from its kept answer."""
        assert plan.body is not None
        self.dynamo.after_response(turn, plan.body, self.transport.sent_headers(req, plan))


def turn_flow(
    sessions: TurnSessions[KT],
    admission: TurnAdmission,
    dynamo: Dynamo,
    live: Configured,
    transport: Transport[R, S, KT],
) -> TurnFlow[R, Turn, S, KT]:
    """An intercepted request's turn (:class:`~kvproxy.proxy.turn.TurnFlow`) through
    the Dynamo layer down to ``transport``: the server's and the lab's, built once."""
    return TurnFlow(sessions, admission, DynamoLayer(dynamo, live, transport))


class KeepAnswer:
    """The ordinary request's answer, kept on its turn for the speculative prefill; a
    streamed answer starts the prefill at its ``[DONE]`` (the router may hold the stream
    open a while after it)."""

    __slots__ = ("_layer", "_plan", "_req", "_turn")

    def __init__(self, layer: DynamoLayer[Any, Any, Any], req: Any, plan: Plan, turn: Turn) -> None:
        self._layer = layer
        self._req = req
        self._plan = plan
        self._turn = turn

    def body(self, data: bytes) -> None:
        self._turn.keep_body(data)

    def stream(self, answer: StreamAnswer) -> None:
        """Called from within the relay, which goes on: a failed prefill must not break
        the client's stream."""
        self._turn.keep_stream(answer)
        try:
            self._layer.prefill(self._req, self._plan, self._turn)
        except Exception:
            log.exception("speculative prefill of a streamed answer failed")


__all__ = ["Configured", "DynamoLayer", "KeepAnswer", "Transport", "turn_flow"]
