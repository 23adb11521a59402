"""kvproxy.heap: the mallopt calls for server.malloc_retain_bytes, and (on glibc, in a
fresh interpreter) that they keep a big buffer's pages from being faulted in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from kvproxy import heap
from kvproxy.config import ConfigError, from_mapping

MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("retain", "calls"),
    [
        (0, ()),
        (MIB, ((heap.M_MMAP_THRESHOLD, MIB), (heap.M_TRIM_THRESHOLD, MIB))),
        # The mmap threshold is capped where glibc caps it; the trim threshold is not.
        (64 * MIB, ((heap.M_MMAP_THRESHOLD, 32 * MIB), (heap.M_TRIM_THRESHOLD, 64 * MIB))),
    ],
)
def test_options_for_retain_bytes(retain: int, calls: tuple[tuple[int, int], ...]) -> None:
    assert heap.options(retain) == calls


def test_apply_says_what_it_did() -> None:
    seen: list[tuple[int, int]] = []

    def accept(param: int, value: int) -> int:
        seen.append((param, value))
        return 1

    assert heap.apply(0, accept) == "off" and seen == []
    assert heap.apply(8 * MIB, accept) == "applied"
    assert seen == list(heap.options(8 * MIB))
    # glibc returns 0 for a value it does not take: every call is still tried.
    refused: list[int] = []
    assert heap.apply(8 * MIB, lambda p, v: refused.append(p) or 0) == "refused"
    assert refused == [heap.M_MMAP_THRESHOLD, heap.M_TRIM_THRESHOLD]


def test_apply_without_glibc_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "glibc_mallopt", lambda: None)
    assert heap.apply(8 * MIB) == "unavailable"


def test_config_default_and_range() -> None:
    assert from_mapping({}).server.malloc_retain_bytes == 64 * MIB
    assert from_mapping({"server": {"malloc_retain_bytes": 0}}).server.malloc_retain_bytes == 0
    for bad in (1, MIB - 1, 2**31):
        with pytest.raises(ConfigError, match=r"server\.malloc_retain_bytes: must be 0"):
            from_mapping({"server": {"malloc_retain_bytes": bad}})


# Four 1 MB buffers made and freed per round, as a big body's read, splice and send do;
# the process's minor page faults per round, from /proc/self/stat.
_ROUNDS = """
import sys
from kvproxy import heap
print(heap.apply(int(sys.argv[1])))
def faults():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])
src = bytes(range(256)) * 4096
for warm in range(5):
    a = src[1:]; b = bytearray(a); c = bytes(b); d = b"".join([c[:10], c[10:]])
    del a, b, c, d
before = faults()
for _ in range(100):
    a = src[1:]; b = bytearray(a); c = bytes(b); d = b"".join([c[:10], c[10:]])
    del a, b, c, d
print((faults() - before) / 100)
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt's thresholds are glibc's; elsewhere kvproxy.heap does nothing",
)
def test_retained_buffers_are_not_faulted_in_again() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, str(64 * MIB)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out[0] == "applied"
    # Without it glibc hands the freed megabytes back each round: about 1,000 faults
    # (256 per fresh megabyte). Kept, the same pages serve every round.
    assert float(out[1]) < 20, out
