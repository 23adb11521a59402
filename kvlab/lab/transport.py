"""The workload's in-process Transport: what the HTTP driver sends, handed to the proxy.

Each turn becomes the body and headers the workload's HTTP driver
(:class:`kvlab.workload.driver.HttpTransport`) posts to ``/generate``: the body of
``kvlab.workload.wire.generate_body`` (``input_ids``, ``max_new_tokens`` with
``ignore_eos``, ``stream``), ``X-Session-ID`` and ``X-SMG-Routing-Key`` = the session
id, and ``X-Session-Final`` on a session's last turn when ``send_final`` (off by
default, as in the driver). The lab also names every request's rid (a fixed-length
counter, so aborts by rid prefix stay exact): the proxy would otherwise draw a random
one, and a lab run must be reproducible.

The TTFT is the time from the call to the engine's first token (what the driver
measures at the first streamed chunk); the latency is the time to the last.
"""

from __future__ import annotations

import asyncio

from kvlab.lab.peer_proxy import PeerProxy
from kvlab.lab.proxy import LabProxy, ProxyError
from kvlab.workload.model import TurnOutcome
from kvlab.workload.wire import (
    FINAL_HEADER,
    ROUTING_KEY_HEADER,
    SESSION_HEADER,
    generate_body,
)


class LabTransport:
    """``kvlab.workload.runner.Transport`` over a :class:`LabProxy`."""

    def __init__(self, proxy: LabProxy | PeerProxy, *, send_final: bool = False) -> None:
        self.proxy = proxy
        self.send_final = send_final
        self._rid = 0
        self.errors: dict[str, int] = {}

    async def generate(
        self, session_id: str, input_ids: list[int], max_new_tokens: int, *, final: bool
    ) -> TurnOutcome:
        loop = asyncio.get_running_loop()
        self._rid += 1
        body = generate_body(input_ids, max_new_tokens)
        body["rid"] = f"{self._rid:032x}"
        headers = {SESSION_HEADER: session_id, ROUTING_KEY_HEADER: session_id}
        if final and self.send_final:
            headers[FINAL_HEADER] = "1"
        start = loop.time()
        try:
            req, wait_s = await self.proxy.generate(headers, body)
        except ProxyError as exc:
            self.errors[exc.error_type] = self.errors.get(exc.error_type, 0) + 1
            now = loop.time() - start
            return TurnOutcome(
                [], len(input_ids), 0, 0, now, now, ok=False, error=f"{exc.error_type}: {exc}"
            )
        end = loop.time()
        finish = req.finish_reason or {}
        ok = finish.get("type") != "abort"
        first = req.first_token_time
        assert req.out is not None
        return TurnOutcome(
            output_ids=req.out.ids(req.generated),
            prompt_tokens=req.prompt_tokens,
            cached_tokens=req.cached_tokens,
            completion_tokens=req.generated,
            ttft_s=(first if first is not None else end) - start,
            latency_s=end - start,
            ok=ok,
            error=None if ok else "aborted",
            finish_reason=finish.get("type"),
            admission_wait_ms=None if wait_s is None else wait_s * 1000.0,
        )

    async def close(self, session_id: str) -> None:
        await self.proxy.close_session(session_id)

    async def tool_call(self, session_id: str, seconds: float) -> None:
        """``POST /kvproxy/sessions/{id}/prefetch {"in_s": seconds}`` to the proxy."""
        admission = self.proxy.admission
        if admission is not None and not admission.expect_tool_end(session_id, seconds):
            self.errors["tool_hint_refused"] = self.errors.get("tool_hint_refused", 0) + 1
