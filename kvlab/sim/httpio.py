"""The simulated engine's HTTP edges (shell): a request's JSON body in, JSON out.

The decoding and the bodies are pure (:func:`kvlab.sim.parse.parse_json_object`,
:mod:`kvlab.sim.responses`); this module only reads and writes aiohttp's objects.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from kvlab.sim.parse import parse_json_object
from kvlab.sim.responses import error_body, validation_error_body


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object (``{}`` for an empty body); raises
    :class:`~kvlab.sim.parse.BadRequest` for anything else."""
    return parse_json_object(await request.read())


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's ``_create_error_response``: ``{"error": {"message": ...}}``."""
    return json_response(error_body(message), status)


def validation_error_response(message: str) -> web.Response:
    """SGLang's handler for request-validation errors (HTTP 400)."""
    return json_response(validation_error_body(message), 400)
