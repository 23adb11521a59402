"""The proxy benchmark's saturation with several workers (scripts/benchproxy): which
one-worker target a ``-wN`` target is judged against, where the host's cores went in a
run (the load generator, the upstream, redis-server, each worker, the rest), and the
nginx upstream's configuration."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bp() -> Iterator[dict[str, ModuleType]]:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from benchproxy import common, report, runner, targets

        yield {"common": common, "report": report, "runner": runner, "targets": targets}
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.parametrize(
    ("target", "single"),
    [
        ("off-w2", "off"),
        ("both-redis-w2", "both-redis"),
        ("admission-ring-redis-w2", "admission-ring-redis"),
        ("both-ring-redis-w2", "both-ring-redis"),
        ("off-w2:compiled", "off:compiled"),
        ("off", None),
        ("both-ring-redis", None),
        ("direct", None),
    ],
)
def test_a_target_with_workers_is_judged_against_its_one_worker_twin(
    bp: dict[str, ModuleType], target: str, single: str | None
) -> None:
    common = bp["common"]
    assert common.one_worker_of(target) == single
    if single is not None:
        assert common.known_target(single)


def test_shared_admission_targets_mirror_the_ring_on_redis(bp: dict[str, ModuleType]) -> None:
    """Program admission shares its ledger between workers only when it mirrors the
    ring: the admission targets of the workers' comparison do."""
    common, targets = bp["common"], bp["targets"]
    targets._REDIS["url"] = "redis://127.0.0.1:1/0"
    try:
        for name in ("admission-ring-redis", "admission-ring-redis-w2", "both-ring-redis-w2"):
            doc = targets.proxy_config_doc(name, "http://127.0.0.1:2")
            assert doc["router"]["policy"] == "consistent_hashing"
            assert doc["state"]["backend"] == "redis"
            assert doc["admission"]["enabled"] is True
        assert common.WORKERS["admission-ring-redis-w2"] == 2
        assert common.WORKERS.get("admission-ring-redis", 1) == 1
    finally:
        targets._REDIS.pop("url", None)


def _snap(generator: float, upstream: float, redis: float | None, proxy: dict[int, float],
          host: float, irq: float) -> dict[str, Any]:  # fmt: skip
    return {
        "generator": generator,
        "upstream": upstream,
        "redis": redis,
        "proxy": proxy,
        "host": host,
        "irq": irq,
    }


def test_the_cores_of_a_run_are_shared_out_by_process(bp: dict[str, ModuleType]) -> None:
    runner = bp["runner"]
    before = _snap(10.0, 5.0, 1.0, {100: 2.0, 101: 50.0, 102: 60.0}, 1000.0, 20.0)
    # 4 s: the parent (100) waits, its workers use 3.2 and 2.8 CPU seconds.
    after = _snap(10.8, 5.4, 1.2, {100: 2.004, 101: 53.2, 102: 62.8}, 1008.0, 20.4)
    cores = runner.cores_used(before, after, 4.0)
    assert cores["generator"] == pytest.approx(0.2)
    assert cores["upstream"] == pytest.approx(0.1)
    assert cores["redis"] == pytest.approx(0.05)
    assert cores["irq"] == pytest.approx(0.1)
    assert cores["proxy_workers"] == pytest.approx([0.8, 0.7])  # the parent left out
    assert cores["proxy"] == pytest.approx(1.501)  # ... but counted
    assert cores["host"] == pytest.approx(2.0)
    assert cores["other"] == pytest.approx(2.0 - 0.2 - 0.1 - 0.05 - 1.501 - 0.1)


def test_a_process_missing_from_a_reading_counts_nothing(bp: dict[str, ModuleType]) -> None:
    runner = bp["runner"]
    before = _snap(0.0, 1.0, None, {7: 1.0}, 10.0, 0.0)
    after = _snap(0.5, 1.5, None, {7: 2.0, 8: 9.0}, 12.0, 0.0)  # 8: started in between
    cores = runner.cores_used(before, after, 1.0)
    assert cores["redis"] is None
    assert cores["proxy"] == pytest.approx(1.0)
    assert cores["proxy_workers"] == pytest.approx([1.0])
    assert cores["other"] == pytest.approx(0.0)


def test_rounds_give_medians_and_req_per_proxy_core(bp: dict[str, ModuleType]) -> None:
    runner = bp["runner"]

    def run(rps: float, proxy: float, workers: list[float]) -> dict[str, Any]:
        cores = {"generator": 0.1, "upstream": 0.05, "redis": None, "irq": 0.1, "host": 2.0,
                 "other": 0.1, "proxy": proxy, "proxy_workers": workers}  # fmt: skip
        return {"rps": rps, "cores": cores}

    runs = [run(4000.0, 1.0, [0.5, 0.5]), run(6000.0, 1.5, [0.8, 0.7]), run(3000.0, 0.5, [0.5])]
    med = runner.median_cores(runs)
    assert med["proxy"] == pytest.approx(1.0)
    assert med["proxy_workers"] == [0.5, 0.5]  # the round of the median total
    assert med["redis"] is None
    assert med["rps_per_proxy_core"] == pytest.approx(4000.0)  # of 4000, 4000, 6000
    assert runner.median_cores([{"rps": 1.0}]) == {}


def test_workers_are_judged_on_req_s_and_shown_per_core(bp: dict[str, ModuleType]) -> None:
    report = bp["report"]

    def runs(*rps: float) -> list[dict[str, float]]:
        return [{"rps": r} for r in rps]

    sat = {
        "runs": {
            "off": runs(1000.0, 1000.0, 1000.0),
            "off-w2": runs(1800.0, 1700.0, 1500.0),  # 1.8, 1.7, 1.5: median 1.7
            "both-ring-redis": runs(500.0, 500.0, 500.0),
            "both-ring-redis-w2": runs(600.0, 650.0, 700.0),  # 1.3x
            "admission-ring-redis-w2": runs(900.0),  # its one-worker twin did not run
        },
        "targets": {
            "off": {"cores": {"rps_per_proxy_core": 1000.0}},
            "off-w2": {"cores": {"rps_per_proxy_core": 950.0}},
            "both-ring-redis": {"cores": {}},
            "both-ring-redis-w2": {"cores": {}},
            "admission-ring-redis-w2": {},
        },
    }
    checks = {c[0]: (c[1], c[2], c[3]) for c in report._workers_checks(sat)}
    assert set(checks) == {"off-w2", "both-ring-redis-w2"}
    assert checks["off-w2"] == (
        ">= 1.70x off's req/s at saturation (median of round ratios)",
        "1.70x; req/s per proxy core 0.95x off's",
        True,
    )
    assert checks["both-ring-redis-w2"][1:] == ("1.30x", False)


def test_the_cores_table_lists_each_worker(bp: dict[str, ModuleType]) -> None:
    report = bp["report"]
    sat = {
        "targets": {
            "off-w2": {
                "rps_median": 7000.0,
                "cores": {
                    "generator": 0.1,
                    "upstream": 0.05,
                    "redis": None,
                    "irq": 0.1,
                    "proxy": 1.5,
                    "proxy_workers": [0.8, 0.7],
                    "other": 0.2,
                    "host": 1.95,
                    "rps_per_proxy_core": 4667.0,
                },
            },
            "direct": {"rps_median": 9000.0},  # no readings: no row
        }
    }
    table = report.cpu_table(sat)
    assert (
        "| off-w2 | 7000 | 0.10 | 0.05 | - | 1.50 (0.80 + 0.70) | 0.10 | 0.20 | 1.95 | 4667 |"
        in table
    )
    assert "direct" not in table


def test_a_process_tree_holds_the_children(bp: dict[str, ModuleType]) -> None:
    targets = bp["targets"]
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        tree = targets.process_tree(os.getpid())
        assert tree[0] == os.getpid()
        assert child.pid in tree
        assert targets.child_pids(child.pid) == []
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)
    assert child.pid not in targets.child_pids(os.getpid())
    host = targets.host_cpu_seconds()
    assert host is not None and host["busy"] >= host["irq"] >= 0.0


def test_nginx_gets_each_answer_escaped_and_no_variable(bp: dict[str, ModuleType]) -> None:
    targets = bp["targets"]
    assert targets.nginx_quote(b'{"a":"b"}') == '\'{"a":"b"}\''
    assert targets.nginx_quote(b"it's\nback\\slash") == "'it\\'s\\nback\\\\slash'"
    with pytest.raises(ValueError, match="variable"):
        targets.nginx_quote(b'{"price":"$5"}')
    conf = targets.nginx_upstream_conf(Path("/tmp/x"), 8123)
    replies = targets.upstream_replies("http://127.0.0.1:8123")
    assert "listen 127.0.0.1:8123" in conf
    for route, key in (("/generate", "generate"), ("/metrics", "metrics"),
                       ("/workers", "workers"), ("/server_info", "server_info")):  # fmt: skip
        assert f"location = {route} " in conf
        assert targets.nginx_quote(replies[key]) in conf
