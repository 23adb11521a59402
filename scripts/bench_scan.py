#!/usr/bin/env python3
"""Request-body reading cost: the byte scanner (kvproxy.proxy.scan) vs a full orjson parse.

For ``/generate`` bodies with ``input_ids``, ``/v1/completions`` bodies with a token-id
``prompt`` (no ``input_ids`` key to find), ``/generate`` bodies with ``text`` and chat
bodies with ``messages``, of about 4 KB, 200 KB and 1 MB, times per call (microseconds):

  full   ``parse_object(raw)`` (orjson.loads) plus the reads a decision makes
  scan   ``scan_object(raw, counted_keys_for(path))`` plus the same reads (prompt
         tokens from the count); chat bodies are parsed directly (no key to count)
  located
         ``scan_object(raw, keys, count=False)``, what session lifecycle reads without
         admission: the same reads less the prompt token count (arrays only located)

"The reads" are what session lifecycle and admission use: session id, rid, priority,
sampling limits, nvext, prompt token count. Each figure is the median over ``--rounds``
rounds of the mean of ``--loops`` calls (after one warm-up round); the bodies come from
a fixed seed. Usage:

    python scripts/bench_scan.py                 # all sizes, table on stdout
    python scripts/bench_scan.py --quick         # fewer loops
    python scripts/bench_scan.py --json results/bench_scan.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from kvproxy.admission.reservation import exact_prompt_tokens
from kvproxy.proxy.body import parse_object
from kvproxy.proxy.scan import BodyScan, counted_keys_for, scan_object

SIZES = {"4KB": 4 * 1024, "200KB": 200 * 1024, "1MB": 1024 * 1024}


def generate_body(target: int, seed: int) -> bytes:
    rng = random.Random(seed)
    doc: dict[str, Any] = {
        "rid": "8f1c2a0e5b6d4c1e9a7b3d2f1e0c9b8a",
        "session_id": "traj-000123",
        "sampling_params": {"max_new_tokens": 512, "temperature": 1.0, "stop_token_ids": [2]},
        "return_logprob": True,
        "stream": False,
        "input_ids": [],
    }
    base = len(orjson.dumps(doc))
    ids: list[int] = []
    size = base
    while size < target:
        tok = rng.randrange(100, 152_000)
        size += len(str(tok)) + 1
        ids.append(tok)
    doc["input_ids"] = ids
    return orjson.dumps(doc)


def completions_body(target: int, seed: int) -> bytes:
    """A ``/v1/completions`` body whose prompt is token ids (and no ``input_ids``)."""
    doc = orjson.loads(generate_body(target, seed))
    return orjson.dumps(
        {"model": "m", "prompt": doc["input_ids"], "max_tokens": 512, "session_id": "traj-000123"}
    )


def text_body(target: int, seed: int) -> bytes:
    """A ``/generate`` body with a text prompt (no token ids to count)."""
    rng = random.Random(seed)
    words = ["def", "return", "self", "import", "the", "value", "(", ")", ":", "\n"]
    text = " ".join(rng.choice(words) for _ in range(target // 5))[: target - 200]
    return orjson.dumps(
        {"text": text, "session_id": "traj-000123", "sampling_params": {"max_new_tokens": 512}}
    )


def chat_body(target: int, seed: int) -> bytes:
    rng = random.Random(seed)
    words = ["the", "agent", "calls", "tool", "result", "file", "diff", "é", "日本", "\n", '"q"']
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a coding agent."}]
    size = 200
    while size < target:
        n = rng.randrange(20, 400)
        content = " ".join(rng.choice(words) for _ in range(n))
        role = "user" if len(messages) % 2 else "assistant"
        messages.append({"role": role, "content": content})
        size += len(orjson.dumps(messages[-1])) + 1
    return orjson.dumps(
        {
            "model": "m",
            "messages": messages,
            "max_completion_tokens": 512,
            "session_id": "traj-000123",
            "nvext": {"agent_hints": {"priority": 1, "osl": 256}},
            "stream": True,
        }
    )


def reads_full(raw: bytes) -> Any:
    body = parse_object(raw)
    assert body is not None
    sp = body.get("sampling_params")
    nvext = body.get("nvext")
    return (
        body.get("session_id"),
        body.get("rid"),
        body.get("priority"),
        sp.get("max_new_tokens") if isinstance(sp, dict) else None,
        body.get("max_completion_tokens"),
        nvext.get("agent_hints") if isinstance(nvext, dict) else None,
        exact_prompt_tokens(body),
    )


def _small_fields(scan: BodyScan) -> tuple[Any, ...]:
    return (
        scan.session_id,
        scan.rid,
        scan.priority,
        scan.max_new_tokens,
        scan.max_completion_tokens,
        scan.agent_hints,
    )


def reads_scan(raw: bytes, keys: tuple[str, ...]) -> Any:
    scan = scan_object(raw, keys)
    assert scan is not None
    return (*_small_fields(scan), scan.prompt_token_count)


def reads_located(raw: bytes, keys: tuple[str, ...]) -> Any:
    scan = scan_object(raw, keys, count=False)
    assert scan is not None
    return _small_fields(scan)


def timeit(fn: Callable[[bytes], Any], raw: bytes, loops: int, rounds: int) -> dict[str, float]:
    fn(raw)
    per_call: list[float] = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn(raw)
        per_call.append((time.perf_counter() - t0) / loops * 1e6)
    per_call = per_call[1:]  # the first round warms up
    return {"median_us": statistics.median(per_call), "min_us": min(per_call)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer loops and rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 7; quick 3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    results: list[dict[str, Any]] = []
    kinds = (
        ("generate+input_ids", generate_body, "/generate"),
        ("completions+prompt ids", completions_body, "/v1/completions"),
        ("generate+text", text_body, "/generate"),
        ("chat+messages", chat_body, "/v1/chat/completions"),
    )
    for kind, make, path in kinds:
        keys = counted_keys_for(path)

        def reads_scan_path(raw: bytes, keys: tuple[str, ...] = keys) -> Any:
            return reads_scan(raw, keys)

        def reads_located_path(raw: bytes, keys: tuple[str, ...] = keys) -> Any:
            return reads_located(raw, keys)

        for label, size in SIZES.items():
            raw = make(size, args.seed)
            assert reads_full(raw) == reads_scan_path(raw), (kind, label)
            assert reads_full(raw)[:-1] == reads_located_path(raw), (kind, label)
            loops = max(3, int((2_000_000 if not args.quick else 400_000) / len(raw)))
            full = timeit(reads_full, raw, loops, rounds)
            scan = timeit(reads_scan_path, raw, loops, rounds)
            located = timeit(reads_located_path, raw, loops, rounds)
            results.append(
                {
                    "body": kind,
                    "size": label,
                    "bytes": len(raw),
                    "path": path,
                    "method": scan_object(raw, keys).method,  # type: ignore[union-attr]
                    "full": full,
                    "scan": scan,
                    "located": located,
                    "speedup": full["median_us"] / scan["median_us"],
                }
            )
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    print("µs per call, median / min over rounds")
    print("| body | size | bytes | scan method | full µs | scan µs | located µs | full / scan |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        cells = " | ".join(
            f"{r[k]['median_us']:.1f} / {r[k]['min_us']:.1f}" for k in ("full", "scan", "located")
        )
        print(
            f"| {r['body']} | {r['size']} | {r['bytes']} | {r['method']} | {cells} | "
            f"{r['speedup']:.2f}x |"
        )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
