"""Fault injection and request recording of the simulated engine (for tests).

:func:`fault_middleware` applies the :class:`~kvlab.sim.config.FaultConfig` knobs
(HTTP 503, added latency) and records requests for ``GET /sim/requests``; it also
turns a :class:`~kvlab.sim.parse.BadRequest` into SGLang's 400. ``/sim/faults``
reads and changes the knobs at run time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import web

from kvlab.sim.config import FaultConfig, validate_faults
from kvlab.sim.httpio import error_response, json_response, read_json, validation_error_response
from kvlab.sim.parse import BadRequest
from kvlab.sim.state import SIM_STATE

DATA_PLANE = frozenset({"/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses"})
HEALTH = frozenset({"/health", "/health_generate"})


@web.middleware
async def fault_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    f = st.faults
    path = request.path
    if path in DATA_PLANE or path in HEALTH or path == "/metrics":
        if f.status_503 and path != "/metrics":
            return error_response("Service Unavailable (simulated fault)", 503)
        if f.latency_s > 0 and path != "/health":
            await asyncio.sleep(f.latency_s)
    if st.recorded is not None and path in DATA_PLANE | {"/close_session", "/abort_request"}:
        st.recorded.append(
            {
                "path": path,
                "method": request.method,
                "headers": {str(k): v for k, v in request.headers.items()},
                "body": (await request.read()).decode("utf-8", "replace"),
            }
        )
    try:
        return await handler(request)
    except BadRequest as e:
        return validation_error_response(e.message) if e.validation else error_response(e.message)


# ----------------------------------------------------------------------------- generation


def faults_json(f: FaultConfig) -> dict[str, Any]:
    return dataclasses.asdict(f)


async def handle_get_faults(request: web.Request) -> web.Response:
    return json_response(faults_json(request.app[SIM_STATE].faults))


async def handle_set_faults(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    body = await read_json(request)
    if body.pop("reset", False) is True:  # back to the faults the engine started with
        st.faults = st.cfg.faults
    allowed = {f.name for f in dataclasses.fields(FaultConfig)}
    unknown = set(body) - allowed
    if unknown:
        raise BadRequest(f"unknown fault knobs: {sorted(unknown)}; allowed: {sorted(allowed)}")
    try:
        new = dataclasses.replace(st.faults, **body)
        validate_faults(new)
        if not isinstance(new.status_503, bool):
            raise ValueError("status_503 must be a boolean")
        if not isinstance(new.latency_s, int | float):
            raise ValueError("latency_s must be a number")
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None
    st.faults = new
    return json_response(faults_json(new))


async def handle_requests(request: web.Request) -> web.Response:
    """The recorded requests, oldest first (empty unless started with --record-requests)."""
    st = request.app[SIM_STATE]
    return json_response({"requests": list(st.recorded or ())})
