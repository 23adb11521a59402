"""The features' builder (kvproxy.wiring): built together, no I/O; how they call one
another; started in order and stopped in reverse; who serves /close_session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest

from kvproxy.config import LiveConfig, from_mapping
from kvproxy.proxy.pipeline import CLOSE_LIFECYCLE, CLOSE_RESIDENCY, CLOSE_ROUTER, close_route
from kvproxy.replication.ledger import SyncedLedger
from kvproxy.wiring import Features

ENGINE = "http://127.0.0.1:1"


class NoHttp:
    """A control-plane client that must not be called while the features are built."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def post(self, url: str, **kwargs: Any) -> Any:
        self.calls.append(url)
        raise aiohttp.ClientConnectionError(url)

    def get(self, url: str, **kwargs: Any) -> Any:
        self.calls.append(url)
        raise aiohttp.ClientConnectionError(url)


class OneEngine:
    def all_engines(self) -> tuple[str, ...]:
        return (ENGINE,)

    def healthy_engines(self) -> tuple[str, ...]:
        return (ENGINE,)

    def ring_workers(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (ENGINE,), (ENGINE,)


def _features(doc: Mapping[str, Any]) -> tuple[Features, NoHttp]:
    http = NoHttp()
    live = LiveConfig(from_mapping({"router": {"policy": "consistent_hashing"}, **doc}))
    return Features(live, http=http, fleet=OneEngine(), clock=lambda: 0.0), http


def test_building_calls_nothing_and_each_feature_gets_its_section() -> None:
    features, http = _features(
        {"session_lifecycle": {"enabled": True}, "admission": {"enabled": True}}
    )
    assert http.calls == []
    assert features.sessions.config is features.live.config.session_lifecycle
    assert features.admission.enabled
    assert features.dynamo.config is features.live.config


def test_a_finished_close_ends_residency_and_dynamo_state() -> None:
    features, _ = _features({"session_lifecycle": {"enabled": True}})
    log: list[str] = []
    # The features stand in for themselves (the compiled build's objects take no new
    # attributes): what the builder's callback tells each one is recorded.
    features.admission = Recorder(features.admission, "admission", log)  # type: ignore[assignment]
    features.dynamo.timers.started("s", 5.0, 0.0)
    features.session_closed("s")
    assert log == ["admission end_session s"]
    assert features.dynamo.timers.timeout_of("s") is None  # Dynamo's timer went too


def test_pressure_and_engine_readings_need_admission_on() -> None:
    off, _ = _features({})
    assert off.pressure(ENGINE) is False and off.pressure(None) is False
    assert off.engine_kv(ENGINE) == (None, None)
    on, _ = _features({"admission": {"enabled": True}})
    assert on.pressure(ENGINE) is False  # no reading yet: not under pressure
    assert on.engine_kv(ENGINE) == (None, None)  # nothing scraped yet


class Recorder:
    """One feature, its start, stop and end_session recorded (then carried out)."""

    def __init__(self, feature: Any, name: str, log: list[str], *, fail: bool = False) -> None:
        self._feature = feature
        self._name = name
        self._log = log
        self._fail = fail

    async def start(self) -> None:
        self._log.append(f"start {self._name}")
        if self._fail:
            raise RuntimeError(f"{self._name} failed")
        await self._feature.start()

    async def stop(self) -> None:
        self._log.append(f"stop {self._name}")
        await self._feature.stop()

    def end_session(self, session_id: str) -> None:
        self._log.append(f"{self._name} end_session {session_id}")
        self._feature.end_session(session_id)


def _recorded(features: Features, log: list[str], fail: str | None = None) -> None:
    for name in ("sessions", "dynamo", "admission"):
        setattr(features, name, Recorder(getattr(features, name), name, log, fail=name == fail))


async def test_they_start_in_order_and_stop_in_reverse() -> None:
    features, _ = _features({"session_lifecycle": {"enabled": True}})
    log: list[str] = []
    _recorded(features, log)
    async with features.running() as running:
        assert running is features
        assert log == ["start sessions", "start dynamo", "start admission"]
    assert log[3:] == ["stop admission", "stop dynamo", "stop sessions"]


async def test_a_feature_that_fails_to_start_stops_those_started() -> None:
    features, _ = _features({})
    log: list[str] = []
    _recorded(features, log, fail="admission")
    with pytest.raises(RuntimeError, match="admission"):
        async with features.running():
            pytest.fail("entered although admission failed to start")
    assert log == [
        "start sessions",
        "start dynamo",
        "start admission",
        "stop dynamo",
        "stop sessions",
    ]


@pytest.mark.parametrize(
    ("lifecycle", "admission", "route"),
    [
        (True, True, CLOSE_LIFECYCLE),
        (True, False, CLOSE_LIFECYCLE),
        (False, True, CLOSE_RESIDENCY),
        (False, False, CLOSE_ROUTER),
    ],
)
def test_who_serves_close_session(lifecycle: bool, admission: bool, route: str) -> None:
    config = from_mapping(
        {"session_lifecycle": {"enabled": lifecycle}, "admission": {"enabled": admission}}
    )
    assert close_route(config) == route


class QuietChannel:
    """A channel for admission's records that says nothing (no I/O while built)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def publish(self, message: str, channel: str | None = None) -> None:
        self.calls.append("publish")

    async def messages(self, channel: str | None = None) -> AsyncIterator[str]:
        self.calls.append("messages")
        await asyncio.Event().wait()
        yield ""  # pragma: no cover - never reached

    async def ping(self) -> None:
        self.calls.append("ping")

    async def close(self) -> None:
        self.calls.append("close")


async def test_with_an_admission_store_the_ledger_is_shared_and_starts_after_admission() -> None:
    live = LiveConfig(
        from_mapping(
            {
                "router": {"policy": "consistent_hashing"},
                "admission": {"enabled": True, "mode": "program", "ledger": "engine"},
                "state": {"backend": "redis"},
            }
        )
    )
    channel = QuietChannel()
    features = Features(
        live, http=NoHttp(), fleet=OneEngine(), clock=lambda: 0.0, admission_store=channel
    )
    assert channel.calls == []  # built, nothing sent
    assert features.replication is not None
    assert isinstance(features.admission.program.ledger, SyncedLedger)
    assert _features({})[0].replication is None  # without a store: this process's alone
    assert any(m.name.startswith("agentic_kv_state_admission") for m in features.collect())
    log: list[str] = []
    _recorded(features, log)
    features.replication = Recorder(features.replication, "replication", log)  # type: ignore[assignment]
    async with features.running():
        assert log[-2:] == ["start admission", "start replication"]
    assert log[4:6] == ["stop replication", "stop admission"]
    assert channel.calls[-1] == "close"
