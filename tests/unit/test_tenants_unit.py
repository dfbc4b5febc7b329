"""Tenants on a shared engine, as pure logic: who a key names, the cool-down after a stopped block,
the router's view of a stalled engine, the engine's step clock."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nnsight_ray.errors import BlockTimeoutError, block_held, held_seconds, intervention_error
from nnsight_ray._internal.observe.progress import Progress
from nnsight_ray.serve import ServeArgs, ServeArgsError
from nnsight_ray.serve.routing import NEVER, STALLED_KEY, StallAwareRouter, routing_stats, split
from nnsight_ray.serve.security import identify
from nnsight_ray.serve.tenants import TenantBook


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stopped(held: float) -> dict:
    return {"type_name": "BlockTimeoutError", "message": f"request r: {block_held(held)} from its start; ..."}


def test_a_stopped_block_is_typed_and_says_how_long_it_held_the_engine():
    error = intervention_error(stopped(1.25), "BlockTimeoutError: ...")
    assert isinstance(error, BlockTimeoutError) and isinstance(error, TimeoutError)
    assert held_seconds(stopped(1.25)) == pytest.approx(1.2, abs=0.06)  # written to a tenth
    # the user's own TimeoutError, or any other error, held nothing the engine stopped
    assert held_seconds({"type_name": "TimeoutError", "message": block_held(3)}) is None
    assert held_seconds(None) is None


def test_cool_downs_start_at_a_stop_add_up_and_end():
    clock = Clock()
    book = TenantBook(3.0, clock)
    assert book.admit("mallory") == (None, False)
    assert book.end("mallory", {"type_name": "ValueError", "message": "boom"}) == 0.0  # ordinary errors are free
    assert book.end("mallory", stopped(1.0)) == pytest.approx(3.0)
    refusal, tracked = book.admit("mallory")
    assert refusal is not None and not tracked and refusal.retry_after_s == pytest.approx(3.0)
    assert "tenant 'mallory'" in refusal.detail and "runaway_penalty=3" in refusal.detail
    assert refusal.headers() == {"Retry-After": "3"}
    assert book.admit("alice") == (None, False) and book.admit(None) == (None, False)
    book.end("mallory", stopped(1.0))  # one sent before the first stop was known: the cool-downs add
    clock.now += 5.9
    assert book.admit("mallory")[0] is not None
    clock.now += 0.2
    assert book.admit("mallory") == (None, True)  # back, on probation: tracked


def test_on_probation_a_tenant_has_one_trace_in_flight_until_it_ends():
    clock = Clock()
    book = TenantBook(3.0, clock)
    book.end("mallory", stopped(1.0))
    clock.now += 3.1
    assert book.admit("mallory") == (None, True)
    second, _ = book.admit("mallory")
    assert second is not None and "one trace at a time" in second.detail
    book.end("mallory", None, tracked=True)  # the first ended well: the slot is free again
    assert book.admit("mallory") == (None, True)
    book.end("mallory", None, tracked=True)
    clock.now += 60.0  # probation over: any number in flight, untracked
    assert book.admit("mallory") == (None, False) and book.admit("mallory") == (None, False)


def test_a_runaway_tenant_gets_at_most_a_quarter_of_the_engine_at_the_default_penalty():
    """A runaway block every 0.25 s for 5 minutes (1 s deadlines), each held until its stop."""
    clock = Clock()
    book, held, running = TenantBook(3.0, clock), 0.0, []  # running: (ends at, tracked)
    start = clock.now
    while clock.now - start < 300:
        clock.now += 0.25
        for ends, tracked in [r for r in running if r[0] <= clock.now]:
            running.remove((ends, tracked))
            book.end("mallory", stopped(1.0), tracked)
        refusal, tracked = book.admit("mallory")
        if refusal is None:
            begins = max([clock.now] + [r[0] for r in running])  # one model thread: blocks run one after another
            running.append((begins + 1.0, tracked))
            held += 1.0
    assert held / 300 <= 0.25 + 0.01


def test_the_penalty_is_off_unless_keys_tell_tenants_apart():
    assert TenantBook(0.0).end("x", stopped(5)) == 0.0
    one = ServeArgs.parse({"model": "/m", "api_key": "k"})
    assert one.penalty(one.resolved_keys({})) == 0.0
    two = ServeArgs.parse({"model": "/m", "api_keys": '{"alice": "a", "bob": "b"}'})
    assert two.resolved_keys({}) == {"alice": "a", "bob": "b"} and two.penalty(two.resolved_keys({})) == 3.0
    both = ServeArgs.parse({"model": "/m", "api_key": "k", "api_keys": {"alice": "a"}, "runaway_penalty": 1})
    assert both.resolved_keys({}) == {"alice": "a", "default": "k"} and both.penalty(both.resolved_keys({})) == 1.0
    with pytest.raises(ServeArgsError, match="same key"):
        ServeArgs.parse({"model": "/m", "api_key": "a", "api_keys": {"alice": "a"}}).resolved_keys({})
    with pytest.raises(ServeArgsError, match="not JSON"):
        ServeArgs.parse({"model": "/m", "api_keys": "alice=a"})
    with pytest.raises(ServeArgsError, match="non-empty key"):
        ServeArgs.parse({"model": "/m", "api_keys": {"alice": ""}})


def test_a_key_names_its_tenant():
    keys = {"alice": "a-key", "bob": "b-key"}
    assert identify([(b"ndif-api-key", b"b-key")], keys) == ("bob", None)
    assert identify([(b"authorization", b"Bearer a-key")], keys) == ("alice", None)
    assert identify([(b"ndif-api-key", b"c-key")], keys)[1][0] == 403
    assert identify([], keys)[1][0] == 401
    assert identify([(b"ndif-api-key", b"k")], "k") == ("default", None)
    assert identify([], None) == (None, None)


def test_the_router_sends_past_a_stalled_engine_unless_every_engine_is():
    replicas = [SimpleNamespace(name=f"r{i}", routing_stats=stats) for i, stats in
                enumerate([{STALLED_KEY: 5.0}, {STALLED_KEY: 0.0}, {}, {STALLED_KEY: 1.9}])]
    moving, stalled = split(replicas, 2.0)
    assert [r.name for r in moving] == ["r1", "r2", "r3"] and [r.name for r in stalled] == ["r0"]
    router = StallAwareRouter.__new__(StallAwareRouter)  # its Ray-side state is not needed to rank
    router.initialize_state(stalled_after_s=2.0)
    for _ in range(20):
        first, last = asyncio.run(router.choose_replicas(replicas))
        assert len(first) == 2 and replicas[0] not in first and last == [replicas[0]]
    only_stalled = asyncio.run(router.choose_replicas([replicas[0]]))
    assert only_stalled == [[replicas[0]]]


def test_a_replica_reports_its_engines_stall_and_never_once_the_engine_is_gone():
    def engine(answer):
        async def load():
            if isinstance(answer, Exception):
                raise answer
            return answer

        return SimpleNamespace(load=SimpleNamespace(remote=load))

    moving = engine({"in_flight": 2, "stalled_s": 0.25, "dead": False})
    assert asyncio.run(routing_stats("ready", moving)) == {STALLED_KEY: 0.25}
    assert asyncio.run(routing_stats("starting", moving)) == {}
    assert asyncio.run(routing_stats("dead", moving)) == {STALLED_KEY: NEVER}
    assert asyncio.run(routing_stats("ready", engine({"in_flight": 1, "stalled_s": 0.0, "dead": True}))) == {
        STALLED_KEY: NEVER}
    assert asyncio.run(routing_stats("ready", engine(RuntimeError("actor died")))) == {STALLED_KEY: NEVER}
    assert asyncio.run(routing_stats("failed", None)) == {STALLED_KEY: NEVER}


def test_the_step_clock_counts_a_stall_only_while_work_waits():
    assert Progress().stalled_s(3) == 0.0  # no clock (an offline engine, vLLM's stats off): no stall reported
    clock = Clock()
    progress = Progress(ticking=True, clock=clock)
    clock.now += 10
    assert progress.stalled_s(0) == 0.0
    progress.busy(was_idle=True)  # work arrives at an idle engine: the wait starts now, not at its last step
    clock.now += 0.5
    assert progress.stalled_s(1) == pytest.approx(0.5)
    progress.step()
    clock.now += 3.0
    progress.busy(was_idle=False)
    assert progress.stalled_s(2) == pytest.approx(3.0)
    logger = progress.stat_logger()(None, 0)
    logger.record(None, None)
    assert progress.stalled_s(2) == 0.0
