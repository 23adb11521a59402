"""Program admission's ledger replicated between replicas (kvproxy.replication.ledger and
the records kvproxy.replication.sync sends): tables with injected clocks, two
replicas' cores side by side, the records carried between them as text."""

from __future__ import annotations

import dataclasses

import pytest

from kvproxy.admission.program.core import ProgramCore
from kvproxy.admission.program.events import Held
from kvproxy.admission.program.params import ProgramParams
from kvproxy.admission.program.session import SessionState
from kvproxy.admission.records import Outcome
from kvproxy.config import StateConfig
from kvproxy.replication.ledger import (
    Engaged,
    Gone,
    Hello,
    Left,
    SessionRec,
    SyncedLedger,
    Waiting,
    decode,
    decode_batch,
    encode,
    encode_batch,
)
from kvproxy.replication.sync import AdmissionSync

E1 = "http://e1:1"
# Capacity 1000, gate off below 750, target 900 (as tests/unit/test_admission_program.py).
P = ProgramParams(
    engage_on_thrash=False,
    headroom=1.0,
    target_start=0.9,
    session_buffer_tokens=0,
    idle_lease_s=5.0,
    idle_half_life_s=10.0,
    new_session_max_wait_s=60.0,
    staleness_s=1e9,
    growth_reservation=False,
)
CFG = StateConfig(backend="redis", replica_ttl_s=5.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0  # the loop's clock (each replica's own)
        self.offset = 1_000_000.0  # wall = now + offset

    def wall(self) -> float:
        return self.now + self.offset


class _NoChannel:
    async def publish(self, message: str, channel: str | None = None) -> None:
        raise AssertionError("no I/O in these tests")

    def messages(self, channel: str | None = None):  # pragma: no cover - never called
        raise AssertionError("no I/O in these tests")

    async def ping(self) -> None:  # pragma: no cover
        pass

    async def close(self) -> None:
        pass


class Replica:
    def __init__(
        self, name: str, clock: Clock, params: ProgramParams = P, offset: float = 0
    ) -> None:
        self.core = ProgramCore(params)
        self.core.ledger.observe_engine(E1, 0.0, max_total_num_tokens=1000)
        self.drains = 0
        self.clock = clock
        self.offset = offset  # this replica's loop clock runs ``offset`` ahead
        self.sync = AdmissionSync(
            CFG,
            _NoChannel(),
            self.core,
            replica=name,
            drain=self._drain,
            clock=lambda: clock.now + offset,
            wall=clock.wall,
        )

    def _drain(self) -> None:
        self.drains += 1
        self.released = self.core.drain(self.now)

    @property
    def now(self) -> float:
        return self.clock.now + self.offset

    def turn(self, ticket: str, sid: str, tokens: int):
        return self.core.request(ticket, sid, E1, tokens, self.now)

    def answer(self, ticket: str, prompt: int, completion: int = 0) -> None:
        self.core.observe_response(
            ticket, self.now, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=None
        )
        self.core.turn_ended(ticket, self.now)

    def send_to(self, *others: Replica) -> str:
        text = encode_batch(self.sync.pending())
        for other in others:
            other.sync.receive(text)
        return text


def pair(params: ProgramParams = P) -> tuple[Replica, Replica, Clock]:
    clock = Clock()
    # B's loop clock is 37 s ahead of A's: records travel on wall time.
    return Replica("a", clock, params), Replica("b", clock, params, offset=37.0), clock


# -- the wire format -------------------------------------------------------------------


@pytest.mark.parametrize(
    "rec",
    [
        SessionRec("r1", 1.5, "s-1", E1, "active", 1200, 33.25, 0, 3, 1, 1.25),
        SessionRec("r1", 2.0, "s 2", E1, "paused", 0, 0.0, 50, 0, 0, 2.0),
        Gone("r2", 3.0, "s-1"),
        Waiting("r1", 4.0, "t-9", E1, 3.5, 130.0),
        Left("r1", 5.0, "t-9"),
        Engaged("r2", 6.0, E1, True, 640),
        Engaged("r2", 6.5, E1, False),
        Hello("r3", 7.0),
        Hello("r3", 7.5, beat=True),
    ],
)
def test_every_record_survives_its_line(rec) -> None:
    assert decode(encode(rec)) == rec
    assert list(decode_batch(encode_batch([rec, rec]))) == [rec, rec]


@pytest.mark.parametrize(
    "line",
    ["", "S\tr\t1", "S\tr\tx\ts\te\tactive\t1\t0\t0\t0\t0\t0", "Z\tr\t1\ts",
     "S\tr\t1\ts\te\tclosed\t1\t0\t0\t0\t0\t0", "E\tr\t1", "E\tr\t1\te\t1", "H\tr\t1\textra"],
)  # fmt: skip
def test_a_malformed_line_is_no_record(line: str) -> None:
    assert decode(line) is None


# -- sessions ------------------------------------------------------------------------------


def test_a_continuing_turn_on_the_other_replica_is_no_new_session() -> None:
    a, b, clock = pair()
    assert a.turn("t1", "s", 600).outcome is Outcome.NEW_ADMITTED
    clock.now += 1
    a.answer("t1", prompt=600, completion=100)
    a.send_to(b)
    # Alone, b would take the second turn for a new session's first; it sees A's.
    s = b.core.ledger.get("s")
    assert s is not None and s.state is SessionState.ACTIVE and s.ctx == 700
    clock.now += 2
    assert b.turn("t2", "s", 800).outcome is Outcome.CONTINUING_FORWARDED
    lone = Replica("c", clock)
    assert lone.turn("t2", "s", 800).outcome is not Outcome.CONTINUING_FORWARDED


def test_each_replica_counts_the_whole_fleets_sessions() -> None:
    a, b, clock = pair()
    for i in range(4):
        a.turn(f"a{i}", f"sa{i}", 100)
        b.turn(f"b{i}", f"sb{i}", 100)
    clock.now += 1
    for i in range(4):
        a.answer(f"a{i}", prompt=100)
        b.answer(f"b{i}", prompt=100)
    a.send_to(b)
    b.send_to(a)
    assert a.core.ledger.undecayed(E1) == b.core.ledger.undecayed(E1) == 800


def test_a_turn_running_elsewhere_keeps_its_session_busy_until_that_replica_is_gone() -> None:
    a, b, clock = pair()
    a.turn("t1", "s", 100)
    a.send_to(b)
    s = b.core.ledger.get("s")
    assert s is not None and s.busy and s.idle_s(b.now + 50) == 0.0
    # The turn is in flight on the engine for b's work-conserving floor too.
    assert b.core.ledger.engine(E1).load.inflight == 1
    clock.now += 4
    assert b.sync.ledger.expire_replicas(b.now, CFG.replica_ttl_s) == []
    clock.now += 2  # a silent for 6 s > replica_ttl_s 5
    assert b.sync.ledger.expire_replicas(b.now, CFG.replica_ttl_s) == ["a"]
    assert not s.busy
    assert b.core.ledger.engine(E1).load.inflight == 0


def test_the_tick_never_pauses_a_session_whose_turn_runs_on_another_replica() -> None:
    # Idle sessions count from their last turn (no lease): the largest session is the one
    # running elsewhere, in flight there, so the pause passes over it to the idle ones.
    a, b, clock = pair(dataclasses.replace(P, idle_lease_s=0.0))
    a.send_to(b)
    b.send_to(a)
    leader, other = (a, b) if a.sync.ledger.leads(E1) else (b, a)
    assert other.turn("x", "remote", 600).outcome is Outcome.NEW_ADMITTED
    other.send_to(leader)
    for i in range(2):
        assert leader.turn(f"i{i}", f"idle{i}", 100).outcome is Outcome.NEW_ADMITTED
    for i in range(2):
        leader.answer(f"i{i}", prompt=300)  # their contexts grew past their first turns
    remote = leader.core.ledger.get("remote")
    assert remote is not None and remote.in_flight and not remote.running
    clock.now += 1  # W = 600 + 600 x 2^-0.1 > 950
    leader.core.tick(leader.now)
    paused = {sid for sid in ("remote", "idle0", "idle1")
              if leader.core.ledger.sessions[sid].state is SessionState.PAUSED}  # fmt: skip
    assert paused == {"idle0", "idle1"}


def test_an_answer_elsewhere_ends_the_turn_in_flight_and_moves_the_engine_on() -> None:
    a, b, clock = pair()
    a.turn("t1", "s", 100)
    a.send_to(b)
    load = b.core.ledger.engine(E1).load
    answers = load.answers
    clock.now += 1
    a.answer("t1", prompt=100)
    a.send_to(b)
    assert load.inflight == 0 and load.answers == answers + 1


@pytest.mark.parametrize(
    ("what", "state"),
    [("pause", SessionState.PAUSED), ("close", None)],
)
def test_a_pause_or_a_close_on_one_replica_reaches_the_other(what: str, state) -> None:
    a, b, clock = pair()
    a.turn("t1", "s", 100)
    clock.now += 1
    a.answer("t1", prompt=100)
    a.send_to(b)
    s = a.core.ledger.get("s")
    assert s is not None
    if what == "pause":
        a.core.ledger.pause(s, a.now)
    else:
        a.core.end_session("s", a.now)
    a.send_to(b)
    got = b.core.ledger.get("s")
    assert (got.state if got else None) is state
    assert b.core.ledger.undecayed(E1) == 0


# A record's state as the receiver's session takes it (through SESSION_TRANSITIONS): the
# session unknown here (opened NEW), then ACTIVE or PAUSED here, or running here.
@pytest.mark.parametrize(
    ("here", "sent", "after"),
    [
        (None, "paused", SessionState.PAUSED),  # admitted, then paused, on the sender
        (None, "active", SessionState.ACTIVE),
        ("active", "paused", SessionState.PAUSED),
        ("paused", "paused", SessionState.PAUSED),  # already paused: nothing more
        ("paused", "active", SessionState.ACTIVE),
        ("active", "new", SessionState.ACTIVE),  # a session is not un-admitted
        ("running", "paused", SessionState.ACTIVE),  # its turn here decides
    ],
)
def test_a_records_state_goes_through_the_sessions_transitions(
    here: str | None, sent: str, after: SessionState
) -> None:
    led = SyncedLedger(P, "a")
    led.observe_engine(E1, 0.0, max_total_num_tokens=1000)
    if here is not None:
        s = led.open("s", E1, 1.0, 100)
        led.activate(s)
        if here == "paused":
            led.pause(s, 1.0)
        elif here == "running":
            led.turn_started(s, 1.0, 100)
    freed = led.engine(E1).freed_tokens
    rec = SessionRec("b", 10.0, "s", E1, sent, 400, 0.0, 0, 1, 0, 9.0)
    assert led.apply(rec, 10.0, 10.0)
    s = led.get("s")
    assert s is not None and s.state is after
    assert (s.sid in led.engine(E1).sessions) is (after is SessionState.ACTIVE)
    paused_now = after is SessionState.PAUSED and here != "paused"
    assert (
        led.engine(E1).freed_tokens > freed if paused_now else led.engine(E1).freed_tokens == freed
    )


def test_an_older_record_does_not_undo_a_newer_one() -> None:
    a, b, clock = pair()
    a.turn("t1", "s", 100)
    clock.now += 1
    a.answer("t1", prompt=100)
    old = encode_batch(a.sync.pending())
    clock.now += 1
    a.turn("t2", "s", 300)
    clock.now += 1
    a.answer("t2", prompt=300)
    a.send_to(b)
    b.sync.receive(old)
    s = b.core.ledger.get("s")
    assert s is not None and s.ctx == 300 and s.turns == 2


def test_what_another_replica_says_is_not_echoed_back() -> None:
    a, b, _ = pair()
    a.turn("t1", "s", 100)
    a.send_to(b)
    assert [r for r in b.sync.pending() if isinstance(r, SessionRec)] == []


# -- the fleet's waiting order --------------------------------------------------------------


def _fill(a: Replica, b: Replica, clock: Clock, tokens: int = 800) -> None:
    a.turn("f", "full", tokens)
    clock.now += 1
    a.answer("f", prompt=tokens)
    a.send_to(b)


def test_a_first_turn_waits_behind_one_queued_earlier_on_another_replica() -> None:
    a, b, clock = pair()
    _fill(a, b, clock)  # 800 of the 900 the target allows
    clock.now += 1
    first = a.turn("big", "s-big", 500)  # does not fit: it waits on A
    assert first.outcome is None and first.held is not None
    a.send_to(b)
    clock.now += 1
    later = b.turn("small", "s-small", 50)  # fits, but A's turn came first
    assert later.outcome is None and later.held is Held.NEW_SESSION_FIT
    # A's waiter leaves (its client went away): B's turn goes, drained by the record.
    assert a.core.cancel("big")
    a.send_to(b)
    assert b.drains >= 1
    assert [r.outcome for r in b.released] == [Outcome.NEW_WAITED]


def test_without_a_waiter_elsewhere_the_same_turn_goes_at_once() -> None:
    a, b, clock = pair()
    _fill(a, b, clock)
    clock.now += 2
    assert b.turn("small", "s-small", 50).outcome is Outcome.NEW_ADMITTED


def test_a_gone_replicas_waiters_stop_holding_anyone() -> None:
    a, b, clock = pair()
    _fill(a, b, clock)
    clock.now += 1
    a.turn("big", "s-big", 500)
    a.send_to(b)
    clock.now += CFG.replica_ttl_s + 1
    assert b.sync.ledger.expire_replicas(b.now, CFG.replica_ttl_s) == ["a"]
    assert b.turn("small", "s-small", 50).outcome is Outcome.NEW_ADMITTED


# -- engagement and liveness -------------------------------------------------------------------


def test_an_engine_another_replica_engaged_holds_here_too() -> None:
    params = dataclasses.replace(P, engage_on_thrash=True)
    a, b, _ = pair(params)
    assert not b.core.ledger.engaged(E1)
    a.core.ledger.engine(E1).engagement.engaged = True
    a.send_to(b)
    assert b.core.ledger.engaged(E1)
    a.core.ledger.engine(E1).engagement.engaged = False
    a.core.ledger.engine(E1).shared_prefix = 300  # (its first turns' cached prefix)
    a.send_to(b)
    assert not b.core.ledger.engaged(E1)
    assert b.core.ledger.engine(E1).shared_prefix == 300


def test_a_hello_makes_the_others_send_their_whole_view() -> None:
    a, b, clock = pair()
    a.turn("t1", "s", 100)
    assert a.sync.pending()  # sent before B listened: B never got it
    b.sync.receive("")  # B subscribed: it says hello
    hello = encode_batch(b.sync.pending())
    assert decode(hello.split("\n")[0]) == Hello("b", clock.wall())
    a.sync.receive(hello)
    a.send_to(b)
    assert b.core.ledger.get("s") is not None


def test_a_replicas_own_batch_back_from_the_channel_is_not_decoded(monkeypatch) -> None:
    """Every subscriber gets every message, its own included: those are dropped whole,
    before any line is parsed (with two replicas, half of what arrives)."""
    from kvproxy.replication import sync as sync_module

    a, b, _ = pair()
    a.turn("t1", "s", 100)
    own = encode_batch(a.sync.pending())
    decoded: list[str] = []
    real = sync_module.decode_batch

    def counting(text: str):
        decoded.append(text)
        return real(text)

    monkeypatch.setattr(sync_module, "decode_batch", counting)
    assert a.sync.receive(own) == 0
    assert decoded == []
    assert a.core.ledger.get("s").running == 1  # (its own turn, untouched)
    assert b.sync.receive(own) > 0  # the other replica's view of the same batch
    assert decoded == [own]
    assert b.core.ledger.get("s") is not None


def test_a_batch_of_a_replica_whose_name_starts_like_ours_is_applied() -> None:
    clock = Clock()
    a, ab = Replica("a", clock), Replica("ab", clock)
    ab.turn("t1", "s", 100)
    assert a.sync.receive(encode_batch(ab.sync.pending())) > 0
    assert a.core.ledger.get("s") is not None


def test_a_clear_of_the_program_is_followed() -> None:
    a, b, _ = pair()
    a.core.clear()
    assert not isinstance(a.core.ledger, SyncedLedger)
    a.sync.receive("")  # any pass installs it again
    a.turn("t1", "s", 100)
    assert isinstance(a.core.ledger, SyncedLedger)
    a.send_to(b)
    assert b.core.ledger.get("s") is not None


def test_a_record_sent_late_does_not_undo_a_later_change_elsewhere() -> None:
    a, b, clock = pair()
    a.turn("t1", "s", 100)
    clock.now += 1
    a.answer("t1", prompt=100)
    a.send_to(b)
    clock.now += 1
    b.turn("t2", "s", 200)  # b's turn of s ends at T1 ...
    clock.now += 1
    b.answer("t2", prompt=200)
    clock.now += 1
    s = a.core.ledger.get("s")
    assert s is not None
    a.core.ledger.pause(s, a.now)  # ... a pauses s at T2 > T1 (b's turn unseen yet)
    clock.now += 1
    b.send_to(a)  # sent at T3, stamped T1: older than a's pause
    assert s.state is SessionState.PAUSED
    a.send_to(b)
    got = b.core.ledger.get("s")
    assert got is not None and got.state is SessionState.PAUSED and got.ctx == 200


@pytest.mark.parametrize("engine", [E1, "http://e2:1", "http://e3:1", "http://e4:1"])
def test_one_replica_pauses_an_engine_for_the_fleet_and_alone_each_does(engine: str) -> None:
    a, b, _ = pair()
    assert a.sync.ledger.leads(engine) and b.sync.ledger.leads(engine)  # alone: itself
    a.send_to(b)
    b.send_to(a)
    leaders = [r.sync.ledger.leads(engine) for r in (a, b)]
    assert sorted(leaders) == [False, True]
    follower = (a, b)[leaders.index(False)]
    # The tick's pause reads it: a follower holds its pauses back.
    assert follower.core.ledger.engine(engine).load.pauses_undone


class _FlakyChannel(_NoChannel):
    """A channel whose publishes fail while ``down`` (a timeout on a loaded host)."""

    def __init__(self) -> None:
        self.down = True
        self.sent: list[str] = []

    async def publish(self, message: str, channel: str | None = None) -> None:
        if self.down:
            raise TimeoutError
        self.sent.append(message)

    async def ping(self) -> None:
        if self.down:
            raise TimeoutError


async def test_a_replica_whose_send_failed_rejoins_at_its_next_beat() -> None:
    clock = Clock()
    core = ProgramCore(P)
    channel = _FlakyChannel()
    sync = AdmissionSync(
        CFG, channel, core, replica="a", drain=lambda: None, clock=lambda: clock.now,
        wall=clock.wall,
    )  # fmt: skip
    sync._link.up = True  # (as start() sets it; no tasks here)
    core.request("t1", "s", E1, 100, clock.now)
    assert not await sync.flush()  # the publish timed out: this replica falls back
    assert not sync.up
    await sync.beat()  # the store still does not answer
    assert not sync.up and channel.sent == []
    channel.down = False
    await sync.beat()  # it answers: rejoined (the channel never failed, so only here)
    assert sync.up
    assert await sync.flush()
    sent = list(decode_batch(channel.sent[-1]))
    assert isinstance(sent[0], Hello) and not sent[0].beat  # the others send their view
    assert any(isinstance(r, SessionRec) and r.sid == "s" for r in sent)  # and it its own


@pytest.mark.parametrize(
    ("engaged_here", "backoff_here", "third_holds", "taken"),
    [
        (False, 0, False, True),  # the dead replica held it alone: taken over
        (True, 0, False, False),  # engaged here already
        (False, 2, False, False),  # backing off here after a starved release
        (False, 0, True, False),  # another live replica still holds it
    ],
)
def test_an_engine_a_gone_replica_held_engaged_is_taken_over(
    engaged_here: bool, backoff_here: bool, third_holds: bool, taken: bool
) -> None:
    params = dataclasses.replace(P, engage_on_thrash=True, target_start=0.8)
    a, b, clock = pair(params)
    led = b.core.ledger
    eng_b = led.engine(E1, b.now)
    eng_b.engagement.engaged = engaged_here
    eng_b.engagement.backoff = backoff_here
    eng_b.theta = 0.5
    a.core.ledger.engine(E1).engagement.engaged = True
    a.send_to(b)
    assert led.engaged(E1)
    if third_holds:
        wall = clock.wall()
        b.sync.receive(encode_batch([Engaged("c", wall, E1, True)]))
    clock.now += CFG.replica_ttl_s / 2
    if third_holds:  # c beats; a does not
        b.sync.receive(encode_batch([Hello("c", clock.wall(), beat=True)]))
    clock.now += CFG.replica_ttl_s / 2 + 1
    assert "a" in led.expire_replicas(b.now, CFG.replica_ttl_s)
    assert led.taken_over == ([E1] if taken else [])
    assert led.engaged(E1) is (taken or engaged_here or third_holds)
    assert led.locally_engaged(E1) is (taken or engaged_here)
    assert eng_b.theta == (0.8 if taken else 0.5)
    # Taken over, it says so to the others (an engagement record) like its own.
    sent = [r for r in b.sync.pending() if isinstance(r, Engaged)]
    assert [r.engaged for r in sent] == [taken or engaged_here]
