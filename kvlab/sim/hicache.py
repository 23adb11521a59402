"""SGLang's hierarchical KV cache (HiCache): the radix tree with a host-memory tier.

Pure Python, no I/O, time injected as ``now``. Modelled on SGLang's ``HiRadixCache``
(``python/sglang/srt/mem_cache/hiradix_cache.py``) with its host pool
(``mem_cache/memory_pool_host.py``); docs/simulator.md ("HiCache") cites what was read.

* A node's KV lives on the device, on the host, or both. ``backed``: it has a host copy;
  ``evicted``: its device copy was dropped (host only). Host-only nodes always sit below
  device nodes on a path (device eviction takes device *leaves*: nodes whose children
  are all host-only), so a match is a device prefix followed by a host prefix.
* Write policy: ``write_through`` backs a node up when it is inserted or hit once
  (``write_through_threshold`` 1), ``write_through_selective`` at its second hit (2),
  ``write_back`` only when it is evicted from the device. A backup needs host room; the
  host evicts its own LRU host-only leaves for it, and a backup that still does not fit
  is skipped (the node is dropped whole when the device evicts it, as without HiCache).
  Write-through copies run on their own stream and are not charged; a write-back
  eviction waits for its copies (``writing_check(write_back=True)``), so their transfer
  time is a stall (:attr:`HiKVCache.stall_s`) that the scheduler adds to the step.
* Device eviction of a backed-up leaf frees its device slots and keeps the node
  (host only); of a leaf without a host copy it deletes the node. Host eviction
  (``evict_host``) deletes host-only leaves in the same policy order.
* A match that ends in host-only nodes reports ``host_length``; :meth:`load_back` brings
  those nodes back to the device (all or nothing, only if at least
  ``load_back_threshold`` tokens, allocating device slots and evicting for them).
* Inserting over a host-only node (its KV was recomputed because it was not loaded back)
  makes the node device-resident again with the new KV.

Token counts are simulated tokens (the token scale is in :class:`HiCacheConfig`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvlab.sim.config import HiCacheConfig
from kvlab.sim.kvcache import KVCache, MatchResult, Node


class HiKVCache(KVCache):
    """:class:`KVCache` plus SGLang's host tier. See the module docstring."""

    def __init__(
        self,
        max_total_tokens: int,
        hicache: HiCacheConfig,
        eviction_policy: str = "lru",
        session_refs: bool = False,
    ) -> None:
        super().__init__(max_total_tokens, eviction_policy, session_refs)
        self.hicache = hicache
        self.write_policy = hicache.write_policy
        self.write_threshold = 1 if hicache.write_policy == "write_through" else 2
        self.load_back_threshold = hicache.load_back_threshold
        self.host_total = hicache.host_tokens(max_total_tokens)
        self.host_used = 0  # tokens with a host copy (device-resident or not)
        self.host_only = 0  # tokens on the host only (evicted from the device)
        self.backed_up_total = 0  # tokens copied device -> host
        self.loaded_back_total = 0  # tokens copied host -> device
        self.host_evicted_total = 0  # tokens dropped from the host
        self.stall_s = 0.0  # write-back time not yet charged to a step
        self._host_heap: list[tuple] = []
        self._host_seq = 0
        self._pinned: set[int] = set()  # host-only nodes being loaded back

    # ------------------------------------------------------------- structure

    def _is_leaf(self, node: Node) -> bool:
        if node.evicted:
            return False
        return all(child.evicted for child in node.children.values())

    def _split(self, child: Node, k: int) -> Node:
        mid = super()._split(child, k)
        mid.evicted = child.evicted
        mid.backed = child.backed
        mid.hits = child.hits
        return mid

    # ------------------------------------------------------------- matching

    def match_prefix(self, ids: Sequence[int], now: float) -> MatchResult:
        """The device prefix (``length``, ``node``) and the host-only prefix after it."""
        pos, last = self._walk(ids, now, None)
        node = last
        chain: list[Node] = []
        while node.evicted:
            chain.append(node)
            node = node.parent  # type: ignore[assignment]
        host = sum(len(n.key) for n in chain)
        # A backup made room for by host eviction must not drop this match's host part.
        self._pinned = {n.id for n in chain}
        try:
            self._count_hits(node)
        finally:
            self._pinned = set()
        self._push_if_evictable_leaf(node)
        return MatchResult(pos - host, node, host, last if chain else None)

    def _count_hits(self, node: Node) -> None:
        """SGLang's ``inc_hit_count`` on the device nodes of a matched path."""
        if self.write_policy == "write_back":
            return
        while node is not self.root:
            node.hits += 1
            if not node.backed and node.hits >= self.write_threshold:
                self._backup(node)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------- insertion

    def insert(self, ids: Sequence[int], now: float, priority: int = 0) -> tuple[int, Node]:
        """As :meth:`KVCache.insert`; host-only nodes on the path take the caller's KV
        (they count as not yet cached), and a new leaf is written through."""
        n = len(ids)
        pos, last = self._walk(ids, now, priority)
        node = last
        host = 0
        while node.evicted:
            size = len(node.key)
            node.evicted = False
            node.version += 1
            host += size
            node = node.parent  # type: ignore[assignment]
        self.host_only -= host
        self.evictable += host
        self._count_hits(node)
        node = last
        if pos < n:
            leaf = node = self._add_leaf(node, ids, pos, now, priority)
            if self.write_policy != "write_back":
                leaf.hits = 1
                if self.write_threshold <= 1:
                    self._backup(leaf)
        self._push_if_evictable_leaf(node)
        return pos - host, node

    # ---------------------------------------------------------------- host

    def _backup(self, node: Node) -> bool:
        """Give ``node`` a host copy if the host has (or can make) room."""
        size = len(node.key)
        if not self._host_alloc(size):
            return False
        node.backed = True
        self.host_used += size
        self.backed_up_total += size
        return True

    def _host_alloc(self, n: int) -> bool:
        free = self.host_total - self.host_used
        if n > free:
            self.evict_host(n - free)
            free = self.host_total - self.host_used
        return n <= free

    def _push_host(self, node: Node) -> None:
        node.version += 1
        self._host_seq += 1
        heapq.heappush(self._host_heap, (self._key(node), self._host_seq, node.version, node))

    def evict_host(self, num_tokens: int) -> int:
        """Drop host-only leaves in policy order until ``num_tokens`` are freed."""
        freed = 0
        while freed < num_tokens and self._host_heap:
            _, _, version, node = heapq.heappop(self._host_heap)
            if (
                version != node.version
                or node.parent is None
                or not node.evicted
                or node.children
                or node.id in self._pinned
            ):
                continue
            size = len(node.key)
            parent = self._unlink(node)
            self.host_used -= size
            self.host_only -= size
            self.host_evicted_total += size
            freed += size
            if parent.evicted and not parent.children:
                self._push_host(parent)
        return freed

    # ------------------------------------------------------------- eviction

    def _evict_leaf(self, node: Node) -> int:
        if not node.backed and self.write_policy == "write_back" and self._backup(node):
            self.stall_s += self.hicache.transfer_s(len(node.key))
        if not node.backed:
            self._drop_host_children(node)
            return self._delete_leaf(node)
        size = len(node.key)
        node.evicted = True
        node.version += 1
        self.evictable -= size
        self.available += size
        self.evicted_total += size
        self.host_only += size
        parent = node.parent
        assert parent is not None
        if not node.children:
            self._push_host(node)
        if parent is not self.root and parent.lock_ref == 0 and self._is_leaf(parent):
            self._push(parent)
        return size

    def _drop_host_children(self, node: Node) -> None:
        """Delete the host-only subtrees under ``node`` (it is about to be deleted)."""
        stack = list(node.children.values())
        order: list[Node] = []
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(child.children.values())
        for child in reversed(order):  # leaves first
            size = len(child.key)
            self._unlink(child)
            self.host_used -= size
            self.host_only -= size
            self.host_evicted_total += size

    # ------------------------------------------------------------ load back

    def load_back(self, m: MatchResult) -> Node | None:
        """Bring the host-only nodes of match ``m`` back to the device (the caller holds
        a lock on ``m.node``). Returns the new last device node, or None when the hit is
        under the threshold or the device has no room (the tokens are then recomputed)."""
        if m.host_node is None or m.host_length < self.load_back_threshold:
            return None
        chain: list[Node] = []
        node = m.host_node
        while node is not m.node:
            chain.append(node)
            node = node.parent  # type: ignore[assignment]
        self._pinned = {n.id for n in chain}
        try:
            ok = self.alloc(m.host_length)
        finally:
            self._pinned = set()
        if not ok:
            return None
        for node in chain:
            node.evicted = False
            node.version += 1
        self.host_only -= m.host_length
        self.evictable += m.host_length
        self.loaded_back_total += m.host_length
        return m.host_node

    def take_stall(self) -> float:
        """The write-back stall accumulated since the last call."""
        s, self.stall_s = self.stall_s, 0.0
        return s

    # ---------------------------------------------------------------- reset

    def reset(self) -> bool:
        if not super().reset():
            return False
        self.host_used = self.host_only = 0
        self._host_heap.clear()
        return True

    def check_invariants(self, private_tokens: int = 0) -> None:
        super().check_invariants(private_tokens)
        used = only = 0
        for node in self._iter_nodes():
            if node.backed:
                used += len(node.key)
            if node.evicted:
                assert node.backed, "a node off the device without a host copy"
                only += len(node.key)
                for child in node.children.values():
                    assert child.evicted, "a device node below a host-only node"
        assert used == self.host_used, (used, self.host_used)
        assert only == self.host_only, (only, self.host_only)
        assert self.host_used <= self.host_total, (self.host_used, self.host_total)
