"""The state operations as Redis commands: one Lua script per operation (atomic, one
command each, so a batch of them is one pipelined round trip), and the pure encoding
of an operation (:mod:`kvproxy.state.core`) into a call and of a reply into its answer.

A claim makes its replica owe the session's close (``owed``), as a final turn does.

Keys, under ``state.key_prefix`` P: ``P s:<id>`` (hash: ``last``, ``owed``, ``n:<replica>``),
``P c:<id>`` (close claim or ``closed``), ``P idx`` and ``P owed`` (sorted sets of
session ids by last activity), ``P r:<replica>`` (heartbeat), ``P l:<name>`` (lease),
``P f:<replica>`` (hash: its in-flight rids -> session id), ``P fr`` (sorted set of the
replicas with in-flight rids), ``P g:<replica>`` (when a sweep first found it gone),
channel ``P events``. Every key gets a TTL when written. Standalone Redis (the sweep's
script reads keys it derives from the index; not for Redis Cluster).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvproxy.state.core import (
    MAX_RIDS,
    ORPHAN_REPLICAS,
    Begin,
    Claim,
    Due,
    End,
    Finish,
    Heartbeat,
    Lease,
    Op,
    Orphans,
    Peek,
    Restore,
    gone_ttl_s,
)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


# Shared by the scripts that move a session's last activity forward.
_TOUCH = """
local function touch(skey, idx, sid, now, ttl_ms)
  local last = tonumber(redis.call('HGET', skey, 'last') or '-1')
  if tonumber(now) >= last then
    redis.call('HSET', skey, 'last', now)
    redis.call('ZADD', idx, now, sid)
  else
    redis.call('ZADD', idx, last, sid)
  end
  redis.call('PEXPIRE', skey, ttl_ms)
  redis.call('PEXPIRE', idx, ttl_ms)
end
"""

# A request's rids (ARGV from ``first`` on) in or out of its replica's in-flight hash.
_RIDS = """
local function rids_in(fkey, fr, replica, sid, now, ttl_ms, A, first)
  if #A < first then return end
  local n = redis.call('HLEN', fkey)
  for i = first, #A do
    if n < MAX_RIDS then redis.call('HSET', fkey, A[i], sid); n = n + 1 end
  end
  redis.call('PEXPIRE', fkey, ttl_ms)
  redis.call('ZADD', fr, now, replica)
  redis.call('PEXPIRE', fr, ttl_ms)
end
local function rids_out(fkey, ttl_ms, A, first)
  if #A < first or redis.call('EXISTS', fkey) == 0 then return end
  for i = first, #A do redis.call('HDEL', fkey, A[i]) end
  redis.call('PEXPIRE', fkey, ttl_ms)
end
""".replace("MAX_RIDS", str(MAX_RIDS))

_WRITES = (
    _TOUCH
    + _RIDS
    + """
local function op_begin(K, A)
  rids_in(K[5], K[6], A[2], A[1], A[3], A[4], A, 6)
  local c = redis.call('GET', K[2])
  if c and c ~= 'closed' then return 'closing' end
  local answer = 'open'
  if c == 'closed' then redis.call('DEL', K[2]); answer = 'reopened' end
  redis.call('HINCRBY', K[1], 'n:' .. A[2], 1)
  touch(K[1], K[3], A[1], A[3], A[4])
  if A[5] == '1' then
    redis.call('HSET', K[1], 'owed', A[2])
    redis.call('ZADD', K[4], A[3], A[1])
    redis.call('PEXPIRE', K[4], A[4])
  end
  return answer
end
local function op_end(K, A)
  rids_out(K[3], A[4], A, 5)
  if redis.call('EXISTS', K[1]) == 0 then return 0 end
  local n = redis.call('HINCRBY', K[1], 'n:' .. A[2], -1)
  if n <= 0 then redis.call('HDEL', K[1], 'n:' .. A[2]) end
  touch(K[1], K[2], A[1], A[3], A[4])
  return 1
end
local function op_restore(K, A)
  if redis.call('EXISTS', K[2]) == 1 then return 0 end
  if tonumber(A[4]) > 0 then
    redis.call('HSET', K[1], 'n:' .. A[2], A[4])
  else
    redis.call('HDEL', K[1], 'n:' .. A[2])
  end
  touch(K[1], K[3], A[1], A[3], A[5])
  return 1
end
local function op_finish(K, A)
  redis.call('DEL', K[1])
  redis.call('ZREM', K[3], A[1])
  redis.call('ZREM', K[4], A[1])
  redis.call('SET', K[2], 'closed', 'PX', A[2])
  return 0
end
"""
)

SCRIPTS: dict[str, str] = {
    # The writer's operations (begin, end, restore, finish) in one command. ARGV: per
    # operation its name, its number of keys and of arguments, then those.
    "batch": _WRITES
    + """
local ops = {begin = op_begin, ['end'] = op_end, restore = op_restore, finish = op_finish}
local out, i = {}, 1
while i <= #ARGV do
  local name, nk, na = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local K, A = {}, {}
  for j = 1, nk do K[j] = ARGV[i + 2 + j] end
  for j = 1, na do A[j] = ARGV[i + 2 + nk + j] end
  out[#out + 1] = ops[name](K, A)
  i = i + 3 + nk + na
end
return out
""",
    # KEYS: s, c, idx, owed, f, fr. ARGV: sid, replica, now, ttl_ms, final, rids...
    "begin": _WRITES + "return op_begin(KEYS, ARGV)\n",
    # KEYS: s, idx, f. ARGV: sid, replica, now, ttl_ms, rids...
    "end": _WRITES + "return op_end(KEYS, ARGV)\n",
    # KEYS: s, c, idx. ARGV: sid, replica, last, in_flight, ttl_ms
    "restore": _WRITES + "return op_restore(KEYS, ARGV)\n",
    # KEYS: s, c, idx, owed. ARGV: sid, closed_ttl_ms
    "finish": _WRITES + "return op_finish(KEYS, ARGV)\n",
    # KEYS: r, c... ARGV: replica, ttl_ms
    "heartbeat": """
redis.call('SET', KEYS[1], '1', 'PX', ARGV[2])
local renewed = 0
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2]); renewed = renewed + 1
  end
end
return renewed
""",
    # KEYS: c, s, owed. ARGV: replica, ttl_ms, sid, now. The claimer owes the close:
    # should it die before finishing, the sweep finds the session due once the claim
    # has expired with it.
    "claim": """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'owed', ARGV[1])
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
  redis.call('PEXPIRE', KEYS[3], math.max(redis.call('PTTL', KEYS[3]), redis.call('PTTL', KEYS[2])))
end
return 1
""",
    # KEYS: l. ARGV: replica, ttl_ms
    "lease": """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
""",
    # KEYS: idx, owed. ARGV: prefix, now, idle ('' = none), limit
    "due": """
local prefix, now, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
local seen, found = {}, {}
local function alive(r) return redis.call('EXISTS', prefix .. 'r:' .. r) == 1 end
local function consider(sid)
  if seen[sid] then return end
  seen[sid] = true
  local skey = prefix .. 's:' .. sid
  if redis.call('EXISTS', skey) == 0 then
    redis.call('ZREM', KEYS[1], sid); redis.call('ZREM', KEYS[2], sid); return
  end
  if redis.call('EXISTS', prefix .. 'c:' .. sid) == 1 then return end
  local h = redis.call('HGETALL', skey)
  local last, owed = 0, ''
  for i = 1, #h, 2 do
    local k, v = h[i], h[i + 1]
    if k == 'last' then last = tonumber(v)
    elseif k == 'owed' then owed = v
    elseif string.sub(k, 1, 2) == 'n:' and tonumber(v) > 0 and alive(string.sub(k, 3)) then
      return
    end
  end
  local idle = ARGV[3] ~= '' and now - last >= tonumber(ARGV[3])
  local orphan = owed ~= '' and not alive(owed)
  if idle or orphan then table.insert(found, {last, sid}) end
end
if ARGV[3] ~= '' then
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]),
    'LIMIT', 0, limit * 4)
  for _, sid in ipairs(ids) do consider(sid) end
end
for _, sid in ipairs(redis.call('ZRANGE', KEYS[2], 0, limit * 4 - 1)) do consider(sid) end
table.sort(found, function(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] end
  return a[2] < b[2]
end)
local out = {}
for i = 1, math.min(limit, #found) do out[i] = found[i][2] end
return out
""",
    # KEYS: fr. ARGV: prefix, now, grace, limit, gone_ttl_ms, most replicas looked at
    "orphans": """
local prefix, now, grace, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local replicas = redis.call('ZRANGE', KEYS[1], 0, -1)
table.sort(replicas)
local out = {}
for i = 1, math.min(#replicas, tonumber(ARGV[6])) do
  if #out >= limit then break end
  local r = replicas[i]
  local fkey, gkey = prefix .. 'f:' .. r, prefix .. 'g:' .. r
  if redis.call('EXISTS', prefix .. 'r:' .. r) == 1 then
    redis.call('DEL', gkey)
  elseif redis.call('EXISTS', fkey) == 0 then
    redis.call('ZREM', KEYS[1], r); redis.call('DEL', gkey)
  else
    local marked = redis.call('GET', gkey)
    if not marked then
      redis.call('SET', gkey, ARGV[2], 'PX', ARGV[5])
    elseif now - tonumber(marked) >= grace then
      local rids = redis.call('HKEYS', fkey)
      table.sort(rids)
      for j = 1, math.min(#rids, limit - #out) do
        redis.call('HDEL', fkey, rids[j]); out[#out + 1] = rids[j]
      end
      if redis.call('EXISTS', fkey) == 0 then
        redis.call('ZREM', KEYS[1], r); redis.call('DEL', gkey)
      end
    end
  end
end
return out
""",
    # KEYS: s, c
    "peek": """
local out = redis.call('HGETALL', KEYS[1])
local c = redis.call('GET', KEYS[2])
if c then table.insert(out, 'close'); table.insert(out, c) end
return out
""",
}


@dataclass(frozen=True, slots=True)
class Call:
    """One command of a pipeline: a script by name (``script``) or a plain command."""

    script: str | None
    keys: tuple[str, ...]
    args: tuple[str | int | float, ...]


def _f(value: float) -> str:
    return repr(float(value))


def encode(op: Op, prefix: str) -> Call:
    """The Redis call that runs ``op``. Pure."""
    p = prefix
    keys: tuple[str, ...]
    if isinstance(op, Begin):
        sid = op.session_id
        keys = (
            f"{p}s:{sid}", f"{p}c:{sid}", f"{p}idx", f"{p}owed", f"{p}f:{op.replica}", f"{p}fr",
        )  # fmt: skip
        final = "1" if op.final else "0"
        args: tuple[str | int | float, ...] = (
            sid, op.replica, _f(op.now), _ms(op.ttl_s), final, *op.rids,
        )  # fmt: skip
        return Call("begin", keys, args)
    if isinstance(op, End):
        sid = op.session_id
        keys = (f"{p}s:{sid}", f"{p}idx", f"{p}f:{op.replica}")
        return Call("end", keys, (sid, op.replica, _f(op.now), _ms(op.ttl_s), *op.rids))
    if isinstance(op, Restore):
        sid = op.session_id
        keys = (f"{p}s:{sid}", f"{p}c:{sid}", f"{p}idx")
        args = (sid, op.replica, _f(op.last), op.in_flight, _ms(op.ttl_s))
        return Call("restore", keys, args)
    if isinstance(op, Claim):
        sid = op.session_id
        keys = (f"{p}c:{sid}", f"{p}s:{sid}", f"{p}owed")
        return Call("claim", keys, (op.replica, _ms(op.ttl_s), sid, _f(op.now)))
    if isinstance(op, Finish):
        sid = op.session_id
        keys = (f"{p}s:{sid}", f"{p}c:{sid}", f"{p}idx", f"{p}owed")
        return Call("finish", keys, (sid, _ms(op.closed_ttl_s)))
    if isinstance(op, Heartbeat):
        keys = (f"{p}r:{op.replica}", *(f"{p}c:{sid}" for sid in op.closing))
        return Call("heartbeat", keys, (op.replica, _ms(op.ttl_s)))
    if isinstance(op, Lease):
        return Call("lease", (f"{p}l:{op.name}",), (op.replica, _ms(op.ttl_s)))
    if isinstance(op, Due):
        idle = "" if op.idle_timeout_s is None else _f(op.idle_timeout_s)
        return Call("due", (f"{p}idx", f"{p}owed"), (p, _f(op.now), idle, op.limit))
    if isinstance(op, Orphans):
        args = (
            p,
            _f(op.now),
            _f(op.grace_s),
            op.limit,
            _ms(gone_ttl_s(op.grace_s)),
            ORPHAN_REPLICAS,
        )
        return Call("orphans", (f"{p}fr",), args)
    if isinstance(op, Peek):
        sid = op.session_id
        return Call("peek", (f"{p}s:{sid}", f"{p}c:{sid}"), ())
    raise TypeError(f"not a state operation: {op!r}")


_WRITER_SCRIPTS = frozenset({"begin", "end", "restore", "finish"})


def batched(ops: Sequence[Op], prefix: str) -> list[tuple[Call, int]]:
    """The calls that run ``ops`` in order: consecutive writer operations (begin, end,
    restore, finish) folded into one ``batch`` script call, each with how many of the
    operations it runs (its reply is then the list of their replies). Pure."""
    out: list[tuple[Call, int]] = []
    folded: list[str | int | float] = []
    count = 0
    for op in ops:
        call = encode(op, prefix)
        if call.script in _WRITER_SCRIPTS:
            folded += [call.script, len(call.keys), len(call.args), *call.keys, *call.args]
            count += 1
            continue
        if count:
            out.append((Call("batch", (), tuple(folded)), count))
            folded, count = [], 0
        out.append((call, 1))
    if count:
        out.append((Call("batch", (), tuple(folded)), count))
    return out


def decode(op: Op, raw: Any) -> Any:
    """The answer of ``op`` from its Redis reply (decoded strings). Pure."""
    if isinstance(op, Begin):
        return str(raw)
    if isinstance(op, End | Restore | Claim | Lease):
        return bool(raw)
    if isinstance(op, Finish):
        return None
    if isinstance(op, Heartbeat):
        return int(raw)
    if isinstance(op, Due | Orphans):
        return [str(x) for x in raw]
    if isinstance(op, Peek):
        return _peek(list(raw))
    raise TypeError(f"not a state operation: {op!r}")


def _peek(flat: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fields = dict(zip(flat[0::2], flat[1::2], strict=True))
    if "last" in fields:
        out["last"] = float(fields["last"])
        out["in_flight"] = {
            k[2:]: int(v) for k, v in fields.items() if k.startswith("n:") and int(v) > 0
        }
        out["owed"] = fields.get("owed", "")
    if "close" in fields:
        out["close"] = fields["close"]
    return out
