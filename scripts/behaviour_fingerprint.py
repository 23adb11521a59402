"""A fingerprint of admission's behaviour: one digest over decisions, stats and /metrics
text of a scripted scenario through both modes, and a few short deterministic lab runs.

A refactoring that changes no rule leaves the digest unchanged: run this on the commit
before and the commit after, and compare the first line. The scenario drives
:class:`~kvproxy.admission.coordinator.AdmissionController` through its public methods
only, with an injected clock and engines' metrics served from memory (no network):

* request mode (``mode: request``): leases, waiting in the two FIFOs, a release that
  admits the next, aging past ``max_wait_s``, an oversized body, a protected one, a
  cancelled waiter, a session that ends;
* program mode (``mode: program``, ``ledger: engine``, a mirrored ring over two
  engines): new sessions that fit or wait, continuing turns, usage reports, ticks
  with the clock moving, a pause under growth, a session that ends, a reload; once
  as configured and once at a time scale of 0.5 and a token scale of 4.

Then ``kvproxy lab`` (virtual time) on swe and rl at small sizes, policies off and both,
seed 0, with the wall-clock fields left out.

Usage: ``python scripts/behaviour_fingerprint.py [--no-lab] [--json PATH]``. Prints
``sha256 <digest>`` and then the JSON the digest is taken over.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, generate_latest

from kvproxy.admission.coordinator import AdmissionController
from kvproxy.admission.records import AdmissionRequest, Decision
from kvproxy.config import AdmissionConfig
from kvproxy.fleet.ring import HashRing

A, B = "http://a:1", "http://b:1"
LAB_RUNS = (
    ["--workload", "swe", "--engines", "2", "--sessions-per-engine", "6", "--sessions", "16"],
    ["--workload", "rl", "--engines", "2", "--sessions-per-engine", "6", "--sessions", "16"],
)
# Fields of a lab row measured on the wall clock (and the command line, which names a
# temporary file), not in virtual time.
WALL_FIELDS = {"wall_s", "speedup", "command"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def metrics_text(cap: int, usage: float, evicted: int = 0) -> str:
    return (
        f'sglang:max_total_num_tokens{{model_name="m"}} {cap}\n'
        f'sglang:token_usage{{model_name="m"}} {usage}\n'
        f'sglang:evicted_tokens_total{{model_name="m",cache_type="RadixCache"}} {evicted}\n'
    )


def request(ticket: str, sid: str | None, tokens: int, **extra: Any) -> AdmissionRequest:
    headers = CIMultiDict(extra.pop("headers", {}))
    body = {"input_ids": [1] * tokens, "sampling_params": {"max_new_tokens": 16}, **extra}
    return AdmissionRequest(ticket, "/generate", headers, body, sid)


def show(d: Decision) -> dict[str, Any]:
    return {
        "action": str(d.action),
        "reason": str(d.reason),
        "lease": d.lease_id,
        "tokens": d.tokens,
        "wait_s": round(d.wait_s, 9),
        "priority": d.priority,
    }


def metrics_of(ctl: AdmissionController) -> str:
    registry = CollectorRegistry()
    registry.register(ctl)  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def observe(ctl: AdmissionController) -> dict[str, Any]:
    health = ctl.health()
    return {
        "stats": ctl.stats(),
        "totals": dict(ctl.totals()),
        "health": repr(health),
        "metrics": metrics_of(ctl),
        "waiting": ctl.waiting,
        "oldest_wait_s": round(ctl.oldest_wait_s(), 9),
    }


class Script:
    """Admissions held open by name, decided at once or awaited, with a log of each."""

    def __init__(self, ctl: AdmissionController, clock: Clock) -> None:
        self.ctl = ctl
        self.clock = clock
        self.log: list[Any] = []
        self.open: dict[str, Any] = {}
        self.reqs: dict[str, AdmissionRequest] = {}
        self.tasks: dict[str, asyncio.Task[Decision]] = {}

    def admit(self, name: str, req: AdmissionRequest) -> None:
        adm = self.ctl.admit(req)
        self.reqs[name] = req
        self.open[name] = adm
        d = adm.decide_now()
        if d is not None:
            self.log.append([name, "now", show(d)])
        else:
            self.tasks[name] = asyncio.ensure_future(adm.wait())
            self.log.append([name, "waits"])

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        for name, task in list(self.tasks.items()):
            if task.done():
                del self.tasks[name]
                if task.cancelled():
                    self.log.append([name, "cancelled-task"])
                else:
                    self.log.append([name, "resolved", show(task.result())])

    def leave(self, name: str) -> None:
        self.open.pop(name).leave()
        self.log.append([name, "left"])

    def cancel_task(self, name: str) -> None:
        self.tasks[name].cancel()

    def at(self, t: float) -> None:
        self.clock.now = t
        self.log.append(["clock", t])

    def mark(self, label: str) -> None:
        self.log.append([label, observe(self.ctl)])


def controller(
    clock: Clock,
    caps: dict[str, tuple[int, float]],
    time_scale: float = 1.0,
    token_scale: int = 1,
    **cfg: Any,
) -> AdmissionController:
    async def fetch(url: str) -> str:
        cap, usage = caps[url]
        return metrics_text(cap, usage)

    settings: dict[str, Any] = {
        "enabled": True,
        "poll_interval_s": 3600.0,
        "staleness_s": 3600.0,
        **cfg,
    }
    return AdmissionController(
        AdmissionConfig(**settings),
        healthy_engines=lambda: list(caps),
        http=None,
        clock=clock,
        fetch_metrics=fetch,
        router_policy="consistent_hashing",
        server_info={u: {"radix_eviction_policy": "priority"} for u in caps},
        time_scale=time_scale,
        token_scale=token_scale,
    )


async def request_mode() -> list[Any]:
    clock = Clock()
    caps = {A: (1000, 0.0), B: (1000, 0.0)}
    ctl = controller(clock, caps, mode="request", headroom=1.0, max_wait_s=50.0, max_queue=3)
    s = Script(ctl, clock)
    await ctl.poll_once()
    s.admit("r1", request("t1", "s1", 600))
    s.admit("r2", request("t2", "s2", 700))
    s.admit("r3", request("t3", "s3", 300))
    s.admit("r4", request("t4", None, 900))
    s.admit("big", request("t5", None, 5000))
    s.admit("prot", request("t6", None, 10, headers={"X-KVProxy-Protected": "1"}))
    s.admit("r1dup", request("t1", "s1", 600))
    await s.settle()
    s.mark("after-first")
    s.at(1005.0)
    s.leave("r1")
    await s.settle()
    s.admit("r7", request("t7", "s4", 500))
    await s.settle()
    if "r7" in s.tasks:
        s.cancel_task("r7")
    await s.settle()
    s.mark("after-cancel")
    s.at(1060.0)
    await ctl.poll_once()
    await s.settle()
    s.leave("r2")
    await s.settle()
    ctl.end_session("s1")
    ctl.end_session("s2")
    s.admit("r8", request("t8", "s1", 100))
    await s.settle()
    s.mark("after-end")
    for name in list(s.open):
        if name not in s.tasks:
            s.leave(name)
    await ctl.stop()
    await s.settle()
    s.mark("stopped")
    return s.log


async def program_mode(time_scale: float = 1.0, token_scale: int = 1) -> list[Any]:
    clock = Clock()
    caps = {A: (2000, 0.1), B: (2000, 0.1)}
    ctl = controller(
        clock,
        caps,
        time_scale,
        token_scale,
        mode="program",
        ledger="engine",
        headroom=1.0,
        target_start=0.9,
        session_buffer_tokens=0,
        engage_on_thrash=False,
        priority_steering=True,
        new_session_max_wait_s=40.0,
        paused_soft_wait_s=10.0,
        paused_max_wait_s=60.0,
    )
    s = Script(ctl, clock)
    ring = HashRing([A, B])
    on_a = [k for k in (f"s{i}" for i in range(200)) if ring.owner(k) == A][:6]
    on_b = [k for k in (f"s{i}" for i in range(200)) if ring.owner(k) == B][:2]
    await ctl.poll_once()
    s.mark("start")
    for i, sid in enumerate(on_a[:4]):
        s.admit(f"a{i}", request(f"a{i}-0", sid, 500))
    s.admit("b0", request("b0-0", on_b[0], 300))
    s.admit("nosess", request("x0", None, 100))
    await s.settle()
    s.mark("first-turns")
    for turn in range(1, 6):
        s.at(1000.0 + 3.0 * turn)
        for i, sid in enumerate(on_a[:4]):
            name = f"a{i}"
            if name in s.open and name not in s.tasks:
                prev = s.reqs[name]
                ctl.observe_usage(prev, 500 + 100 * turn, 400 + 90 * turn, 50 + turn)
                s.leave(name)
                s.admit(name, request(f"a{i}-{turn}", sid, 500 + 120 * turn))
        ctl.tick()
        await s.settle()
        s.mark(f"turn-{turn}")
    s.admit("b1", request("b1-0", on_b[1], 1500))
    s.admit("late", request("late-0", on_a[4], 900))
    await s.settle()
    s.at(1030.0)
    ctl.tick()
    await s.settle()
    s.mark("late")
    ctl.end_session(on_a[0])
    await s.settle()
    s.at(1050.0)
    ctl.tick()
    await s.settle()
    s.mark("ended")
    await ctl.reconfigure(dataclass_replace(ctl.config, paused_soft_wait_s=5.0))
    s.at(1100.0)
    await ctl.poll_once()
    ctl.tick()
    await s.settle()
    s.mark("reloaded")
    for name in list(s.open):
        if name not in s.tasks:
            s.leave(name)
    await s.settle()
    s.mark("left")
    await ctl.stop()
    await s.settle()
    s.mark("stopped")
    return s.log


def dataclass_replace(cfg: AdmissionConfig, **changes: Any) -> AdmissionConfig:
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def lab_rows() -> list[Any]:
    out: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, args in enumerate(LAB_RUNS):
            path = Path(tmp) / f"lab{i}.json"
            cmd = [sys.executable, "-m", "kvproxy", "lab", *args]
            cmd += ["--policy", "off,both", "--seeds", "0", "--json", str(path)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            out.append(_strip(json.loads(path.read_text())))
    return out


def _strip(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if k not in WALL_FIELDS}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(fn())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-lab", action="store_true", help="the scripted scenario only")
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args()
    doc: dict[str, Any] = {
        "request_mode": run(request_mode),
        "program_mode": run(program_mode),
        # The same at a time scale and a token scale (server.time_scale, token_scale).
        "program_mode_scaled": run(lambda: program_mode(0.5, 4)),
    }
    if not args.no_lab:
        doc["lab"] = lab_rows()
    text = json.dumps(doc, indent=1, sort_keys=True, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print("sha256", hashlib.sha256(text.encode()).hexdigest())
    print(text)


if __name__ == "__main__":
    main()
