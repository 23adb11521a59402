"""Token-granular KV pool with a radix tree over token ids (page size 1).

Pure Python, no I/O, time injected as ``now`` (simulated seconds). Modelled on
SGLang's ``RadixCache`` / ``UnifiedRadixCache``:

* The pool has ``max_total_tokens`` slots. ``available`` slots are free; every
  other slot belongs either to a tree node or privately to a running request (or
  to a streaming session), and the owner does the bookkeeping through
  :meth:`KVCache.alloc` / :meth:`KVCache.free`.
* Tree nodes hold the KV of a token-id edge. ``lock_ref`` counts the running
  requests whose matched prefix passes through the node; locking walks to the
  root, so an ancestor is never less locked than its descendants.
* ``evictable`` = tokens in nodes with ``lock_ref == 0``. This is SGLang's
  ``evictable_size()``: it includes KV tagged by a session in session-radix mode
  (tags change the eviction order, they are not pins), so
  ``token_usage = (max_total - available - evictable) / max_total`` excludes it.
* Eviction removes unlocked *leaves* only, whole nodes at a time, ordered by the
  policy key: ``lru`` -> (last_access), ``priority`` -> (priority, last_access).
  With session references on, the key is prefixed with "has session refs", so
  unreferenced leaves go first. A heap with lazy invalidation (a per-node version)
  keeps eviction O(log n) per node.
* Session references (``--enable-session-radix-cache``): a finished request tags
  every node on its path with its session id; :meth:`release_session` drops the
  tags (the KV stays as ordinary cache, as in SGLang 0.5.23).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class Node:
    __slots__ = (
        "backed",
        "children",
        "evicted",
        "hits",
        "id",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "priority",
        "sessions",
        "tick",
        "version",
    )

    def __init__(self, key: list[int], parent: Node | None, node_id: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = 0.0
        self.tick = 0
        self.priority = 0
        self.sessions: set[str] | None = None
        self.version = 0
        self.id = node_id
        # HiCache only (kvlab.sim.hicache): the node's KV has a host copy; the node's
        # device KV was dropped (host copy only); how often it was hit (write policy).
        self.backed = False
        self.evicted = False
        self.hits = 0

    def __repr__(self) -> str:
        return f"Node(id={self.id}, len={len(self.key)}, lock={self.lock_ref}, children={len(self.children)})"


@dataclass(frozen=True, slots=True)
class MatchResult:
    length: int  # tokens matched on the device
    node: Node  # the last device node of the match
    # HiCache only: tokens matched beyond ``node`` in host-only nodes, and the last one.
    host_length: int = 0
    host_node: Node | None = None


def _common_prefix(a: Sequence[int], a_off: int, b: list[int]) -> int:
    """Length of the common prefix of ``a[a_off:]`` and ``b``."""
    n = min(len(a) - a_off, len(b))
    if a[a_off : a_off + n] == b[:n]:
        return n
    lo, hi = 0, n  # the first mismatch is in [lo, hi)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if a[a_off + lo : a_off + mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    i = lo
    while i < hi and a[a_off + i] == b[i]:
        i += 1
    return i


class KVCache:
    """KV pool + radix tree. See the module docstring for the model."""

    def __init__(
        self,
        max_total_tokens: int,
        eviction_policy: str = "lru",
        session_refs: bool = False,
    ) -> None:
        if eviction_policy not in ("lru", "priority"):
            raise ValueError(f"unknown eviction policy {eviction_policy!r}")
        self.max_total_tokens = max_total_tokens
        self.eviction_policy = eviction_policy
        self.session_refs = session_refs
        self._next_id = 1
        self.root = Node([], None, 0)
        self.root.lock_ref = 1
        self.available = max_total_tokens
        self.evictable = 0  # tokens in tree nodes with lock_ref == 0
        self.protected = 0  # tokens in tree nodes with lock_ref > 0
        self.evicted_total = 0
        self.num_nodes = 0
        self._tick = 0
        self._heap: list[tuple] = []
        self._heap_seq = 0
        self._session_nodes: dict[str, set[Node]] = {}

    # ------------------------------------------------------------------ pool

    def alloc(self, n: int) -> bool:
        """Take ``n`` free slots, evicting cache if needed. False (nothing taken) if impossible."""
        if n > self.available:
            self.evict(n - self.available)
            if n > self.available:
                return False
        self.available -= n
        return True

    def free(self, n: int) -> None:
        self.available += n
        if self.available > self.max_total_tokens:
            raise AssertionError("KV pool over-freed")

    @property
    def tree_tokens(self) -> int:
        return self.evictable + self.protected

    # ------------------------------------------------------------- matching

    def _touch(self, node: Node, now: float) -> None:
        self._tick += 1
        node.last_access = now
        node.tick = self._tick

    def match_prefix(self, ids: Sequence[int], now: float) -> MatchResult:
        """Longest cached prefix of ``ids``; splits a node on a partial match."""
        pos, node = self._walk(ids, now, None)
        self._push_if_evictable_leaf(node)
        return MatchResult(pos, node)

    def _walk(self, ids: Sequence[int], now: float, priority: int | None) -> tuple[int, Node]:
        """Follow ``ids`` down the tree as far as it is cached: ``(tokens matched, last
        node)``. Touches every node on the path and splits the last one on a partial
        match; with ``priority`` (insertion) ratchets the path's priorities up to it."""
        node = self.root
        pos = 0
        n = len(ids)
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                break
            k = _common_prefix(ids, pos, child.key)
            self._touch(child, now)
            # The priority ratchet of SGLang's RadixCache._insert_helper
            # (python/sglang/srt/mem_cache/radix_cache.py): every node on the inserted
            # path takes max(node.priority, request priority), a split node inherits the
            # (ratcheted) priority, a new leaf gets the request's. Matching alone never
            # changes a priority. PriorityStrategy (mem_cache/evict_policy.py) then evicts
            # by (priority, last access). Requests' priorities reach it whether or not
            # priority scheduling is on (cache_finished_req / cache_unfinished_req pass
            # ``req.priority or 0``).
            if priority is not None and priority > child.priority:
                child.priority = priority
            if k < len(child.key):
                child = self._split(child, k)
                pos += k
                node = child
                break
            pos += k
            node = child
        return pos, node

    def _is_leaf(self, node: Node) -> bool:
        """Whether ``node`` is a leaf for device eviction (HiCache: host-only children
        do not count)."""
        return not node.children

    def _push_if_evictable_leaf(self, node: Node) -> None:
        if node is not self.root and node.lock_ref == 0 and self._is_leaf(node):
            self._push(node)

    def _split(self, child: Node, k: int) -> Node:
        """Split ``child`` so that its first ``k`` tokens become a new parent node."""
        parent = child.parent
        assert parent is not None
        mid = Node(child.key[:k], parent, self._new_id())
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        mid.tick = child.tick
        mid.priority = child.priority
        if child.sessions:
            mid.sessions = set(child.sessions)
            for sid in mid.sessions:
                self._session_nodes[sid].add(mid)
        child.key = child.key[k:]
        child.parent = mid
        mid.children[child.key[0]] = child
        parent.children[mid.key[0]] = mid
        self.num_nodes += 1
        return mid

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # ------------------------------------------------------------- insertion

    def insert(self, ids: Sequence[int], now: float, priority: int = 0) -> tuple[int, Node]:
        """Insert ``ids``; return (tokens that were already cached, last node).

        The caller hands the KV of ``ids[already:]`` over to the tree (it stops
        counting it as private) and frees its own copy of the tokens that were
        already cached beyond what it had locked.
        """
        pos, node = self._walk(ids, now, priority)
        already = pos
        if pos < len(ids):
            node = self._add_leaf(node, ids, pos, now, priority)
        self._push_if_evictable_leaf(node)
        return already, node

    def _add_leaf(
        self, parent: Node, ids: Sequence[int], pos: int, now: float, priority: int
    ) -> Node:
        """A new leaf under ``parent`` holding ``ids[pos:]``. It starts unlocked
        (evictable); a caller that keeps using it locks it."""
        leaf = Node(list(ids[pos:]), parent, self._new_id())
        self._touch(leaf, now)
        leaf.priority = priority
        parent.children[ids[pos]] = leaf
        self.num_nodes += 1
        self.evictable += len(ids) - pos
        return leaf

    # ---------------------------------------------------------------- locks

    def inc_lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                size = len(node.key)
                self.evictable -= size
                self.protected += size
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock(self, node: Node) -> None:
        first = node
        while node is not self.root:
            if node.lock_ref == 1:
                size = len(node.key)
                self.evictable += size
                self.protected -= size
            elif node.lock_ref <= 0:
                raise AssertionError(f"lock underflow on {node!r}")
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]
        if first is not self.root and first.lock_ref == 0 and self._is_leaf(first):
            self._push(first)

    # ------------------------------------------------------------- sessions

    def tag_session(self, node: Node, session_id: str) -> None:
        """Reference every node from ``node`` up to the root with ``session_id``."""
        nodes = self._session_nodes.setdefault(session_id, set())
        start = node
        while node is not self.root:
            if node.sessions is None:
                node.sessions = {session_id}
            elif session_id in node.sessions:
                node = node.parent  # type: ignore[assignment]
                continue
            else:
                node.sessions.add(session_id)
            nodes.add(node)
            node = node.parent  # type: ignore[assignment]
        if start is not self.root and start.lock_ref == 0 and self._is_leaf(start):
            self._push(start)

    def release_session(self, session_id: str) -> int:
        """Drop the session's references; return how many nodes were dereferenced."""
        nodes = self._session_nodes.pop(session_id, None)
        if not nodes:
            return 0
        for node in nodes:
            if node.sessions is not None:
                node.sessions.discard(session_id)
                if not node.sessions:
                    node.sessions = None
                    if node.lock_ref == 0 and self._is_leaf(node):
                        self._push(node)
        return len(nodes)

    def session_tokens(self, session_id: str) -> int:
        return sum(len(n.key) for n in self._session_nodes.get(session_id, ()))

    def referenced_sessions(self) -> list[str]:
        return sorted(self._session_nodes)

    def referenced_evictable_tokens(self) -> int:
        seen: set[int] = set()
        total = 0
        for nodes in self._session_nodes.values():
            for node in nodes:
                if node.id not in seen and node.lock_ref == 0 and not node.evicted:
                    seen.add(node.id)
                    total += len(node.key)
        return total

    # ------------------------------------------------------------- eviction

    def _key(self, node: Node) -> tuple:
        tier = 1 if (self.session_refs and node.sessions) else 0
        if self.eviction_policy == "priority":
            return (tier, node.priority, node.last_access, node.tick)
        return (tier, 0, node.last_access, node.tick)

    def _push(self, node: Node) -> None:
        node.version += 1
        self._heap_seq += 1
        heapq.heappush(self._heap, (self._key(node), self._heap_seq, node.version, node))
        if len(self._heap) > 4 * self.num_nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        entries = []
        for node in self._iter_nodes():
            if node.lock_ref == 0 and not node.evicted and self._is_leaf(node):
                node.version += 1
                self._heap_seq += 1
                entries.append((self._key(node), self._heap_seq, node.version, node))
        heapq.heapify(entries)
        self._heap = entries

    def _iter_nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves in policy order until ``num_tokens`` are freed; return freed."""
        freed = 0
        # ``self._heap`` is read on every turn, never held in a local: a deletion pushes
        # the parent that became a leaf, and that push may rebuild the heap as a new list
        # (bumping every leaf's version), which would leave a held list all stale.
        while freed < num_tokens and self._heap and self.evictable:
            _, _, version, node = heapq.heappop(self._heap)
            if (
                version != node.version
                or node.parent is None
                or node.lock_ref != 0
                or not self._is_leaf(node)
            ):
                continue
            freed += self._evict_leaf(node)
        return freed

    def _evict_leaf(self, node: Node) -> int:
        """Free the device KV of the unlocked leaf ``node``; return the tokens freed."""
        return self._delete_leaf(node)

    def _delete_leaf(self, node: Node) -> int:
        size = len(node.key)
        parent = self._unlink(node)
        self.evictable -= size
        self.available += size
        self.evicted_total += size
        if parent is not self.root and parent.lock_ref == 0 and self._is_leaf(parent):
            self._push(parent)
        return size

    def _unlink(self, node: Node) -> Node:
        """Take ``node`` (no children) out of the tree; return its parent."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[0]]
        node.parent = None
        node.version += 1
        self.num_nodes -= 1
        if node.sessions:
            for sid in node.sessions:
                s = self._session_nodes.get(sid)
                if s is not None:
                    s.discard(node)
                    if not s:
                        del self._session_nodes[sid]
        return parent

    def reset(self) -> bool:
        """``/flush_cache``: drop the whole tree if nothing is locked. False if busy."""
        if self.protected:
            return False
        self.available += self.evictable
        self.evictable = 0
        self.root.children.clear()
        self.num_nodes = 0
        self._heap.clear()
        self._session_nodes.clear()
        return True

    # ---------------------------------------------------------- invariants

    def check_invariants(self, private_tokens: int = 0) -> None:
        """Recompute every counter from the tree; raise AssertionError on mismatch.

        ``private_tokens`` is the KV the caller holds outside the tree.
        """
        ev = pr = count = 0
        for node in self._iter_nodes():
            count += 1
            assert node.key, "empty edge"
            assert node.parent is not None
            assert node.parent.children.get(node.key[0]) is node
            if node.parent is not self.root:
                assert node.parent.lock_ref >= node.lock_ref, "ancestor less locked than child"
            if node.evicted:
                assert node.lock_ref == 0, "locked node off the device"
            elif node.lock_ref == 0:
                ev += len(node.key)
            else:
                pr += len(node.key)
        assert count == self.num_nodes, (count, self.num_nodes)
        assert ev == self.evictable, (ev, self.evictable)
        assert pr == self.protected, (pr, self.protected)
        total = self.available + ev + pr + private_tokens
        assert total == self.max_total_tokens, (
            f"pool leak: available {self.available} + tree {ev + pr} + private "
            f"{private_tokens} != {self.max_total_tokens}"
        )
