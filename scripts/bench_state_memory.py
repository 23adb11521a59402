#!/usr/bin/env python3
"""Redis memory the shared session state takes: N sessions written as kvproxy writes
them (two turns each, from two replicas), then closed (claim, tombstone).

Starts its own redis-server (Debian's, with a password, on 127.0.0.1, no persistence)
and stops it by PID. Prints ``INFO memory``'s ``used_memory`` before, with the sessions
open, and once they are closed (tombstones for ``--closed-ttl`` seconds), as JSON.

    python scripts/bench_state_memory.py --sessions 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlab.stack import start_redis
from kvproxy.config import StateConfig
from kvproxy.state.core import Begin, Claim, End, Finish, Heartbeat, Op
from kvproxy.state.redis_store import RedisStore

BATCH = 500
TTL_S = 3600.0


async def _used(store: RedisStore) -> int:
    return int((await store.info("memory"))["used_memory"])


async def _write(store: RedisStore, ops: list[Op]) -> None:
    for i in range(0, len(ops), BATCH):
        await store.execute(ops[i : i + BATCH])


async def measure(url: str, sessions: int, closed_ttl_s: float) -> dict[str, Any]:
    os.environ["KVPROXY_BENCH_REDIS_PASSWORD"] = os.environ["_BENCH_PW"]
    cfg = StateConfig(
        backend="redis",
        redis_url=url,
        redis_password_env="KVPROXY_BENCH_REDIS_PASSWORD",
        key_prefix="kvproxy:",
        op_timeout_s=5.0,
    )
    store = RedisStore(cfg)
    try:
        await store.ping()
        base = await _used(store)
        now = time.time()
        # A realistic id: a 36-character UUID, as agent frameworks send.
        ids = [
            f"{secrets.token_hex(16)[:8]}-{i:04d}-rollout-session-{i:08d}" for i in range(sessions)
        ]
        ops: list[Op] = [Heartbeat("replica-a", now, 30.0), Heartbeat("replica-b", now, 30.0)]
        for sid in ids:
            ops += [
                Begin(sid, "replica-a", now, TTL_S),
                End(sid, "replica-a", now, TTL_S),
                Begin(sid, "replica-b", now, TTL_S),
            ]
        start = time.perf_counter()
        await _write(store, ops)
        write_s = time.perf_counter() - start
        open_used = await _used(store)
        closes: list[Op] = []
        for sid in ids:
            closes += [
                End(sid, "replica-b", now, TTL_S),
                Claim(sid, "replica-b", now, 30.0),
                Finish(sid, "replica-b", now, closed_ttl_s),
            ]
        await _write(store, closes)
        closed_used = await _used(store)
    finally:
        await store.close()
    return {
        "sessions": sessions,
        "used_memory_empty": base,
        "used_memory_open": open_used,
        "used_memory_closed": closed_used,
        "bytes_per_open_session": round((open_used - base) / sessions, 1),
        "bytes_per_closed_session": round((closed_used - base) / sessions, 1),
        "ops_per_s": round(len(ops) / write_s),
        "closed_ttl_s": closed_ttl_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--closed-ttl", type=float, default=600.0)
    args = parser.parse_args(argv)
    password = secrets.token_hex(16)
    os.environ["_BENCH_PW"] = password
    with tempfile.TemporaryDirectory(prefix="bench_state_") as tmp:
        proc = start_redis(log_dir=Path(tmp), password=password)
        try:
            result = asyncio.run(measure(proc.url, args.sessions, args.closed_ttl))
        finally:
            proc.stop()
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
