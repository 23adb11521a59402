"""The simulated SGLang engine as an aiohttp application: its one factory,
:func:`create_sim_app`, with the route table and the scheduler loops' lifetime.

The pure core (``kvlab.sim.scheduler`` and ``kvlab.sim.kvcache``) does all the
bookkeeping. Around it, by concern:

- ``kvlab.sim.parse``: wire body to scheduler request (shared with the lab);
- ``kvlab.sim.responses``: response bodies (``meta_info``, OpenAI objects, errors);
- ``kvlab.sim.httpio``: reading a JSON body, writing JSON and error responses;
- ``kvlab.sim.rank``: one DP rank's scheduler loop and simulated clock;
- ``kvlab.sim.state``: what the handlers share (:data:`SIM_STATE`);
- ``kvlab.sim.handlers``: the data plane; ``kvlab.sim.streaming``: its SSE;
- ``kvlab.sim.control``: sessions, aborts, flush, health;
- ``kvlab.sim.info``: ``/server_info``, ``/v1/loads``, ``/metrics``, ``/sim/state``;
- ``kvlab.sim.faults``: fault injection and request recording (tests).

One scheduler-loop task per DP rank is started and stopped in ``cleanup_ctx``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from kvlab.sim import control, faults, handlers, info
from kvlab.sim.config import SimConfig
from kvlab.sim.state import SIM_STATE, SimState

__all__ = ["SIM_STATE", "create_sim_app"]


async def _scheduler_loops(app: web.Application) -> AsyncIterator[None]:
    st = app[SIM_STATE]
    st.tasks = [
        asyncio.create_task(r.run(), name=f"kvproxy-sim-scheduler-dp{r.index}") for r in st.ranks
    ]
    yield
    for t in st.tasks:
        t.cancel()
    for t in st.tasks:
        # A crashed loop has logged its exception already.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    # Unblock any handler still waiting (the server is going away).
    for r in st.ranks:
        r.release_all()


def create_sim_app(cfg: SimConfig) -> web.Application:
    """The simulated engine as an aiohttp application (run it, or use it in tests)."""
    app = web.Application(middlewares=[faults.fault_middleware], client_max_size=256 * 1024 * 1024)
    app[SIM_STATE] = SimState(cfg)
    app.cleanup_ctx.append(_scheduler_loops)
    r = app.router
    r.add_post("/generate", handlers.handle_generate)
    r.add_post("/v1/chat/completions", handlers.handle_chat)
    r.add_post("/v1/completions", handlers.handle_completions)
    r.add_post("/v1/responses", handlers.handle_responses)
    for path, handler in (
        ("/open_session", control.handle_open_session),
        ("/close_session", control.handle_close_session),
    ):
        r.add_get(path, handler)
        r.add_post(path, handler)
    r.add_post("/abort_request", control.handle_abort)
    r.add_post("/flush_cache", control.handle_flush_cache)
    for path in ("/health", "/health_generate"):
        r.add_get(path, control.handle_health)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, info.handle_server_info)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, info.handle_model_info)
    r.add_get("/v1/models", info.handle_models)
    r.add_get("/v1/loads", info.handle_loads)
    r.add_get("/metrics", info.handle_metrics)
    r.add_get("/sim/faults", faults.handle_get_faults)
    r.add_post("/sim/faults", faults.handle_set_faults)
    r.add_get("/sim/state", info.handle_state)
    r.add_get("/sim/requests", faults.handle_requests)
    return app
