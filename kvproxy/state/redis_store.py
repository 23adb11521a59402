"""The Redis backend: runs batches of state operations as one pipelined round trip.

A thin shell over ``redis.asyncio`` (with ``hiredis`` parsing when installed): the
scripts and the encoding are :mod:`kvproxy.state.scripts`. The password comes from
the environment variable ``state.redis_password_env`` and is never logged or shown
(:func:`redacted_url`). The ``redis`` package is the optional extra ``kvproxy[redis]``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvproxy.config import StateConfig
from kvproxy.state.core import Op
from kvproxy.state.scripts import SCRIPTS, batched, decode


class StoreUnavailable(RuntimeError):
    """The store could not be reached (or answered with an error)."""


def redacted_url(url: str) -> str:
    """``url`` with any user:password part replaced (for logs and health views)."""
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if "@" in host:
        host = "***@" + host.rpartition("@")[2]
    return f"{scheme}{sep}{host}{slash}{path}"


def password(cfg: StateConfig) -> str | None:
    """The Redis password from the environment (None when unset or empty)."""
    return os.environ.get(cfg.redis_password_env) or None


def _import_redis() -> Any:
    try:
        import redis.asyncio as aioredis  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:  # pragma: no cover - the extra is installed in tests
        raise StoreUnavailable(
            "state.backend: redis needs the redis client: pip install 'kvproxy[redis]'"
        ) from exc
    return aioredis


class RedisStore:
    """One client (a small connection pool) for one replica."""

    def __init__(self, cfg: StateConfig) -> None:
        aioredis = _import_redis()
        self.prefix = cfg.key_prefix
        self.channel = f"{cfg.key_prefix}events"
        self._client: Any = aioredis.Redis.from_url(
            cfg.redis_url,
            password=password(cfg),
            decode_responses=True,
            socket_timeout=max(cfg.op_timeout_s * 4, 0.2),
            socket_connect_timeout=max(cfg.op_timeout_s * 4, 0.2),
            max_connections=16,
        )
        self._shas: dict[str, str] = {}

    async def _load(self) -> None:
        shas = {}
        for name, text in SCRIPTS.items():
            shas[name] = await self._client.script_load(text)
        self._shas = shas

    async def execute(self, ops: Sequence[Op]) -> list[Any]:
        """Run ``ops`` in order in one pipeline; their answers. Raises
        :class:`StoreUnavailable` on any error (a script missing after a restart of
        the server is loaded again for the next call)."""
        calls = batched(ops, self.prefix)
        try:
            if not self._shas:
                await self._load()
            pipe = self._client.pipeline(transaction=False)
            for call, _ in calls:
                if call.script is None:
                    pipe.set(call.keys[0], call.args[0], nx=True, px=call.args[1])
                else:
                    pipe.evalsha(self._shas[call.script], len(call.keys), *call.keys, *call.args)
            replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:
            raise StoreUnavailable(_describe(exc)) from exc
        raw: list[Any] = []
        for (call, count), reply in zip(calls, replies, strict=True):
            if isinstance(reply, Exception):
                if "NOSCRIPT" in str(reply):
                    self._shas = {}
                raise StoreUnavailable(_describe(reply))
            raw.extend(reply if call.script == "batch" else [reply])
            if call.script == "batch" and len(reply) != count:
                raise StoreUnavailable(f"batch answered {len(reply)} of {count} operations")
        return [decode(op, reply) for op, reply in zip(ops, raw, strict=True)]

    async def publish(self, message: str, channel: str | None = None) -> None:
        """PUBLISH ``message`` on ``channel`` (default: the lifecycle's events)."""
        try:
            await self._client.publish(channel or self.channel, message)
        except Exception as exc:
            raise StoreUnavailable(_describe(exc)) from exc

    async def messages(self, channel: str | None = None) -> AsyncIterator[str]:
        """``channel``'s messages (default: the lifecycle's events) until the connection
        fails (then StoreUnavailable); first an empty one once subscribed (what was
        published before it is not received)."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel or self.channel)
            yield ""
            while True:
                msg = await pubsub.get_message(timeout=1.0)
                if msg is not None and msg.get("type") == "message":
                    yield str(msg["data"])
        except Exception as exc:
            raise StoreUnavailable(_describe(exc)) from exc
        finally:
            with contextlib.suppress(Exception):  # the connection is gone already
                await pubsub.aclose()

    async def ping(self) -> None:
        """PING, then load the scripts (a server that restarted has lost them)."""
        try:
            await self._client.ping()
            await self._load()
        except Exception as exc:
            raise StoreUnavailable(_describe(exc)) from exc

    async def info(self, section: str) -> dict[str, Any]:
        try:
            return dict(await self._client.info(section))
        except Exception as exc:
            raise StoreUnavailable(_describe(exc)) from exc

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken client
            await self._client.aclose()


def _describe(exc: BaseException) -> str:
    """The error in one line, never with the password (redis-py's messages carry none;
    URLs are redacted all the same)."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {redacted_url(text) if '://' in text else text}"[:300]
