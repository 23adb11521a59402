"""Which SGLang session mechanism an engine runs, read from its ``/server_info``.

Session lifecycle assumes the *session radix cache* (``--enable-session-radix-cache``,
SGLang >= 0.5.16) with ``--radix-eviction-policy priority``: the injected top-level
``session_id`` tags the session's radix KV and ``/close_session`` drops the session's
references. With *streaming sessions* (``--enable-streaming-session``) close frees the
KV of a session the client opened itself with ``/open_session``. With neither, close
only deletes a legacy session record (if any) and frees nothing.

``/server_info`` (``/get_server_info`` on older engines) returns the engine's server
arguments at the top level; this module reads ``enable_session_radix_cache``,
``radix_eviction_policy``, ``enable_streaming_session``, ``enable_priority_scheduling``,
``disable_radix_cache``, ``version``, ``context_length`` and, for the host KV tier,
``enable_hierarchical_cache`` with ``hicache_write_policy``. Parsing is pure;
:func:`probe` does the I/O.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kvproxy.fleet.client import EngineHttp
from kvproxy.urls import base_url

SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
SESSION_ID_MIN_VERSION = (0, 5, 16)

_SESSION_KEYS = (
    "enable_session_radix_cache",
    "enable_streaming_session",
    "radix_eviction_policy",
)


class EngineProbeError(Exception):
    """The engine's server info could not be read."""


@dataclass(frozen=True, slots=True)
class EngineSessionMode:
    url: str
    session_radix: bool
    streaming: bool
    eviction_policy: str | None
    priority_scheduling: bool
    radix_disabled: bool
    version: str | None
    model: str | None = None
    # False when the reply carried none of the session-related server arguments
    # (an engine too old to have them, or something that is not an SGLang engine).
    recognised: bool = True
    # The engine's context_length (tokens per request), when it reports one.
    context_length: int | None = None
    # Its host KV tier's write policy (SGLang's --hicache-write-policy) when it runs
    # one (--enable-hierarchical-cache); None without a host tier.
    hicache_write_policy: str | None = None

    @property
    def mode(self) -> str:
        """``session_radix``, ``streaming``, ``session_radix+streaming``, ``none`` or ``unknown``."""
        if not self.recognised:
            return "unknown"
        if self.session_radix and self.streaming:
            return "session_radix+streaming"
        if self.session_radix:
            return "session_radix"
        if self.streaming:
            return "streaming"
        return "none"

    @property
    def as_assumed(self) -> bool:
        """The mode session lifecycle is designed for: session radix + priority eviction."""
        return self.session_radix and not self.radix_disabled and self.eviction_policy == "priority"

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "session_radix": self.session_radix,
            "streaming": self.streaming,
            "eviction_policy": self.eviction_policy,
            "priority_scheduling": self.priority_scheduling,
            "radix_disabled": self.radix_disabled,
            "version": self.version,
            "model": self.model,
            "as_assumed": self.as_assumed,
            "hicache_write_policy": self.hicache_write_policy,
        }


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value != 0
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return False


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def parse_server_info(url: str, info: Mapping[str, Any]) -> EngineSessionMode:
    """Turn an engine's ``/server_info`` JSON object into its session mode."""
    policy = _text(info.get("radix_eviction_policy"))
    return EngineSessionMode(
        url=url,
        session_radix=_flag(info.get("enable_session_radix_cache")),
        streaming=_flag(info.get("enable_streaming_session")),
        eviction_policy=policy.lower() if policy else None,
        priority_scheduling=_flag(info.get("enable_priority_scheduling")),
        radix_disabled=_flag(info.get("disable_radix_cache")),
        version=_text(info.get("version")),
        model=_text(info.get("served_model_name") or info.get("model_path")),
        recognised=any(key in info for key in _SESSION_KEYS),
        context_length=_positive_int(info.get("context_length")),
        hicache_write_policy=_hicache_write_policy(info),
    )


def _hicache_write_policy(info: Mapping[str, Any]) -> str | None:
    """The host tier's write policy; SGLang's default (``write_through``) when HiCache is
    on and the reply names none, None when HiCache is off."""
    if not _flag(info.get("enable_hierarchical_cache")):
        return None
    policy = _text(info.get("hicache_write_policy"))
    return policy.lower() if policy else "write_through"


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if value > 0 else None


def parse_version(version: str | None) -> tuple[int, ...] | None:
    """``"0.5.23"`` / ``"0.5.15.post1"`` / ``"v0.5.16rc1"`` -> ``(0, 5, 23)`` etc."""
    if not version:
        return None
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if not m:
        return None
    return tuple(int(g) for g in m.groups(default="0"))


def mode_warnings(modes: Sequence[EngineSessionMode]) -> list[str]:
    """Human-readable warnings about engines that do not run what lifecycle assumes."""
    out: list[str] = []
    for m in modes:
        u = m.url
        if not m.recognised:
            out.append(
                f"engine {u}: /server_info reports no session settings (not an SGLang "
                "engine, or a very old one): close_session may not free KV there"
            )
            continue
        ver = parse_version(m.version)
        if ver is not None and ver < SESSION_ID_MIN_VERSION:
            out.append(
                f"engine {u} runs SGLang {m.version} (< 0.5.16): the top-level session_id "
                "is ignored there"
            )
        if m.radix_disabled:
            out.append(f"engine {u} runs with --disable-radix-cache: session ids cannot tag its KV")
        if not m.session_radix and not m.streaming:
            out.append(
                f"engine {u} runs neither the session radix cache nor streaming sessions: "
                "close_session will not free KV there"
            )
        elif not m.session_radix:
            out.append(
                f"engine {u} runs streaming sessions but not the session radix cache: the "
                "injected session_id does not tag KV there; close_session frees only "
                "streaming sessions the client opened itself"
            )
        elif m.eviction_policy != "priority":
            out.append(
                f"engine {u} runs the session radix cache without --radix-eviction-policy "
                f"priority (policy {m.eviction_policy or 'unknown'})"
            )
    kinds = {m.mode for m in modes if m.recognised}
    if len(kinds) > 1:
        out.append(f"engines run different session modes: {', '.join(sorted(kinds))}")
    return out


async def _get_json(
    http: EngineHttp, url: str, client_timeout: aiohttp.ClientTimeout
) -> tuple[int, Any]:
    async with http.get(url, timeout=client_timeout) as resp:
        raw = await resp.read()
        if not 200 <= resp.status < 300:
            return resp.status, None
        try:
            return resp.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return resp.status, None


async def probe(http: EngineHttp, url: str, timeout_s: float) -> EngineSessionMode:
    """Read ``{url}/server_info`` (falling back to ``/get_server_info``) and parse it.

    Raises :class:`EngineProbeError` when neither answers with a JSON object within
    ``timeout_s`` (one deadline for both attempts).
    """
    base = base_url(url)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    errors: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            for path in SERVER_INFO_PATHS:
                status, info = await _get_json(http, base + path, timeout)
                if isinstance(info, Mapping):
                    return parse_server_info(base, info)
                ok = 200 <= status < 300
                errors.append(f"{path}: HTTP {status}" + (" (not a JSON object)" if ok else ""))
    except TimeoutError as exc:
        raise EngineProbeError(f"{base}: no server info within {timeout_s} s") from exc
    except aiohttp.ClientError as exc:
        raise EngineProbeError(f"{base}: {type(exc).__name__}: {exc}") from exc
    raise EngineProbeError(f"{base}: " + "; ".join(errors))
