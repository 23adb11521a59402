"""The workload's in-process Transport: what the HTTP driver sends, handed to the proxy.

Each turn becomes the body and headers the workload's HTTP driver posts to
``/generate`` (``input_ids``, ``max_new_tokens`` with ``ignore_eos`` so the drawn
output length is the real one, ``X-Session-ID`` and ``X-SMG-Routing-Key`` = the session
id, ``X-Session-Final`` on a session's last turn). The lab also names every request's
rid (a fixed-length counter, so aborts by rid prefix stay exact): the proxy would
otherwise draw a random one, and the lab must be reproducible.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvproxy.lab.proxy import LabProxy, ProxyError
from kvproxy.workload.runner import TurnOutcome


class LabTransport:
    """``kvproxy.workload.runner.Transport`` over a :class:`LabProxy`."""

    def __init__(self, proxy: LabProxy) -> None:
        self.proxy = proxy
        self._rid = 0
        self.errors: dict[str, int] = {}

    async def generate(
        self, session_id: str, input_ids: list[int], max_new_tokens: int, *, final: bool
    ) -> TurnOutcome:
        loop = asyncio.get_running_loop()
        self._rid += 1
        body: dict[str, Any] = {
            "rid": f"{self._rid:032x}",
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        }
        headers = {"X-Session-ID": session_id, "X-SMG-Routing-Key": session_id}
        if final:
            headers["X-Session-Final"] = "1"
        start = loop.time()
        try:
            req, wait_s = await self.proxy.generate(headers, body)
        except ProxyError as exc:
            self.errors[exc.error_type] = self.errors.get(exc.error_type, 0) + 1
            now = loop.time()
            return TurnOutcome(
                [], 0, 0, 0, now - start, now - start, ok=False, error=f"{exc.error_type}: {exc}"
            )
        end = loop.time()
        first = req.first_token_time
        finish = req.finish_reason or {}
        ok = finish.get("type") != "abort"
        assert req.out is not None
        return TurnOutcome(
            output_ids=req.out.ids(req.generated),
            prompt_tokens=req.prompt_tokens,
            cached_tokens=req.cached_tokens,
            completion_tokens=req.generated,
            ttft_s=(first if first is not None else end) - start,
            latency_s=end - start,
            ok=ok,
            error=None if ok else f"aborted: {finish.get('message')}",
            finish_reason=finish.get("type"),
            admission_wait_ms=None if wait_s is None else wait_s * 1000.0,
        )

    async def close(self, session_id: str) -> None:
        await self.proxy.close_session(session_id)
