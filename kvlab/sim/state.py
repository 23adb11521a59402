"""What the simulated engine's handlers share: :class:`SimState` under :data:`SIM_STATE`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import tempfile
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from kvlab.sim import tokenizer
from kvlab.sim.config import FaultConfig, SimConfig, validate_sim_config
from kvlab.sim.metrics import MetricsContext
from kvlab.sim.rank import Rank
from kvlab.sim.scheduler import Scheduler, SimRequest


class SimState:
    """Everything the handlers share (stored under :data:`SIM_STATE`)."""

    def __init__(self, cfg: SimConfig) -> None:
        validate_sim_config(cfg)
        self.cfg = cfg
        self.faults: FaultConfig = cfg.faults
        self.model_path = ensure_model_dir(cfg.model_path, cfg.model_name)
        sched_cfg = cfg.scheduler_config()
        self.ranks = [Rank(i, Scheduler(sched_cfg), cfg.time_scale) for i in range(cfg.dp_size)]
        self.metrics_ctx = MetricsContext(
            model_name=cfg.model_name,
            tp_size=cfg.tp_size,
            enable_priority_scheduling=cfg.enable_priority_scheduling,
            streaming_sessions=cfg.mode == "streaming",
            hicache=cfg.hicache is not None,
        )
        self._rr = 0
        self.created = int(time.time())
        # Last N requests as received (GET /sim/requests), when cfg.record_requests > 0.
        self.recorded: collections.deque[dict[str, Any]] | None = (
            collections.deque(maxlen=cfg.record_requests) if cfg.record_requests > 0 else None
        )
        self.tasks: list[asyncio.Task[None]] = []

    def pick_rank(self, body: Mapping[str, Any], session: str | None) -> Rank:
        n = len(self.ranks)
        if n == 1:
            return self.ranks[0]
        for key in ("routed_dp_rank", "data_parallel_rank"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
                return self.ranks[v]
        if session:
            return self.ranks[zlib.crc32(session.encode()) % n]
        self._rr = (self._rr + 1) % n
        return self.ranks[self._rr]

    def find(self, rid: str) -> tuple[Rank, SimRequest] | None:
        for rank in self.ranks:
            req = rank.sched.requests.get(rid)
            if req is not None:
                return rank, req
        return None


SIM_STATE = web.AppKey("kvproxy_sim_state", SimState)


def ensure_model_dir(path: str | None, model_name: str) -> str:
    """A local directory reported as model_path, so a router never downloads a tokenizer."""
    if path is None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
        path = os.path.join(tempfile.gettempdir(), "kvproxy-sim-model", safe)
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        with contextlib.suppress(OSError):
            cfg_file.write_bytes(
                orjson.dumps(
                    {
                        "architectures": ["Qwen3ForCausalLM"],
                        "model_type": "qwen3",
                        "vocab_size": tokenizer.VOCAB_SIZE,
                        "eos_token_id": tokenizer.EOS_TOKEN_ID,
                        "kvproxy_sim": True,
                    }
                )
            )
    return str(p)


# ----------------------------------------------------------------------------- helpers
