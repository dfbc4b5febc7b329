"""Limits on a request's block (``ranks/limits.py``): the watchdog on real greenlets, the saved-bytes bound.

The block side is a stand-in for nnsight's ``Mediator`` with the same switch contract: the model side
switches into a worker greenlet and gets the thread back when the block parks (switches to its parent)
or ends. No engine, no Ray.
"""

from __future__ import annotations

import time

import pytest
import torch
from greenlet import getcurrent, greenlet

from nnsight_ray._internal.ranks import limits
from nnsight_ray._internal.ranks.limits import Limits, bound_saves, limit, saved_bytes


class Block:
    """A mediator stand-in: ``body(park)`` runs in a greenlet; ``park()`` gives the model side its thread back."""

    def __init__(self, body) -> None:
        self.body = body
        self.worker = None

    def start(self):
        self.worker = greenlet(run=lambda: self.body(self.park))
        return self.switch()

    def park(self):
        return self.worker.parent.switch("parked")

    def switch(self, *args):
        self.worker.parent = getcurrent()
        return self.worker.switch(*args)


@pytest.fixture(autouse=True)
def watchdog():
    limits.WATCHDOG.start()
    yield limits.WATCHDOG
    assert not limits.WATCHDOG.running, "a switch was left registered"


def limited(body, **values) -> Block:
    block = Block(body)
    limit(block, Limits.of(values), "req-1")
    return block


def spin(park):
    i = 0
    while True:
        i += 1


def test_a_spinning_block_is_stopped_near_its_budget_with_a_message_that_says_how_to_raise_it():
    block = limited(spin, block_timeout_s=0.3)
    began = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        block.start()
    took = time.monotonic() - began
    assert 0.3 <= took < 0.8, took
    message = str(raised.value)
    assert "request req-1" in message and "block_timeout_s=0.3" in message
    assert "max_block_timeout_s=600" in message and "trace(..., block_timeout_s=" in message
    assert not block.worker  # the block's greenlet is over


def test_except_exception_in_the_block_does_not_keep_it_running():
    def stubborn(park):
        while True:
            try:
                while True:
                    pass
            except Exception:
                continue

    with pytest.raises(TimeoutError):
        limited(stubborn, block_timeout_s=0.2).start()


def test_deep_recursion_and_a_sleep_are_stopped_and_a_sleep_only_when_it_wakes():
    def recurse(park, depth=0):
        return recurse(park, depth + 1) if depth < 10**9 else None

    with pytest.raises(RecursionError):  # Python's own limit: an ordinary error of the block
        limited(recurse, block_timeout_s=5).start()

    began = time.monotonic()
    with pytest.raises(TimeoutError):
        limited(lambda park: time.sleep(0.6), block_timeout_s=0.1).start()
    assert 0.55 <= time.monotonic() - began < 1.2  # C code is not interrupted: the stop lands when it returns


def test_a_block_that_parks_in_time_runs_to_its_end_and_the_total_budget_counts_every_switch():
    def steps(park):
        for _ in range(4):
            time.sleep(0.1)
            park()
        return "done"

    block = limited(steps, block_timeout_s=0.3, block_total_timeout_s=1.0)
    assert block.start() == "parked"
    for _ in range(3):
        assert block.switch() == "parked"
    assert block.switch() == "done"
    assert 0.35 < block.nnsight_ray_used_s < 0.8

    block = limited(steps, block_timeout_s=0.3, block_total_timeout_s=0.25)
    assert block.start() == "parked"
    with pytest.raises(TimeoutError, match="block_total_timeout_s=0.25"):
        for _ in range(3):
            block.switch()


def test_a_stop_claimed_as_the_block_parks_lands_in_the_switch_not_outside_it(watchdog):
    """The race: the watchdog claims a switch the block is leaving; its stop must arrive inside that switch."""
    block = limited(lambda park: (park(), spin(park)), block_timeout_s=50)
    original = limits.LimitedMediator._leave

    def leave_late(self, switch, key):
        switch.started -= 100  # over budget just as the block parks
        watchdog.check(time.monotonic())  # the watchdog claims it first
        return original(self, switch, key)

    limits.LimitedMediator._leave = leave_late
    try:
        with pytest.raises(TimeoutError):
            block.start()
    finally:
        limits.LimitedMediator._leave = original
    time.sleep(0.05)  # nothing left pending for this thread: the next bytecodes run clean
    assert sum(range(1000)) == 499500


def test_limits_are_validated_and_a_request_cannot_ask_past_the_engines_max():
    engine = Limits.of({"block_timeout_s": 5, "max_block_timeout_s": 60})
    assert engine.block_total_timeout_s == 60  # a default above the given maximum comes down to it
    assert engine.for_request({"block_timeout_s": 60}).block_timeout_s == 60
    assert engine.for_request(None) == engine
    with pytest.raises(ValueError, match="above this engine's max_block_timeout_s=60"):
        engine.for_request({"block_timeout_s": 61})
    with pytest.raises(ValueError, match="unknown block limit 'max_save_bytes'"):
        engine.for_request({"max_save_bytes": 1})
    with pytest.raises(ValueError, match="positive"):
        Limits.of({"block_timeout_s": 0})
    with pytest.raises(ValueError, match="above max_block_timeout_s"):
        Limits.of({"block_timeout_s": 700})
    kwargs = limits.engine_limits({"block_timeout_s": 2, "dtype": "float32"})
    assert kwargs["dtype"] == "float32" and "block_timeout_s" not in kwargs
    assert kwargs["additional_config"][limits.LIMITS_KEY]["block_timeout_s"] == 2
    trace_kwargs = {"block_timeout_s": 3, "temperature": 0.0}
    assert limits.request_limits(trace_kwargs) == {"block_timeout_s": 3} and trace_kwargs == {"temperature": 0.0}


def test_saves_over_the_byte_limit_fail_their_request_only_and_send_nothing():
    big = torch.zeros(1000)
    collected = {
        "big": {"saves": {"h": big, "view": big[:10]}, "error": None, "registered": {},
                "sequences": {0: {"saves": {"h": big}, "registered": {}}}},
        "small": {"saves": {"h": torch.zeros(10)}, "error": None, "registered": {"r": [torch.zeros(5)]},
                  "sequences": {}},
    }
    assert saved_bytes(collected["big"]) == 4040  # each tensor once (the primary sequence is the flat entry too)
    bound_saves(collected, max_bytes=1000)
    big_entry = collected["big"]
    assert big_entry["saves"] == {} and big_entry["sequences"][0]["saves"] == {}
    assert big_entry["error"]["type_name"] == "MemoryError"
    assert "max_save_bytes=1,000" in big_entry["error"]["message"]
    assert collected["small"]["error"] is None and collected["small"]["saves"]["h"].numel() == 10


def test_a_block_that_does_not_stop_within_the_grace_stops_its_rank_with_the_reason(monkeypatch):
    """Stuck in one C call: the stop is sent but never lands; after ``block_stop_grace_s`` the rank is ended."""
    ended = []
    monkeypatch.setattr(limits, "_exit_rank", ended.append)
    dog = limits.Watchdog()
    block = Block(spin)
    limit(block, Limits.of({"block_timeout_s": 1, "block_stop_grace_s": 2}), "req-9")
    switch = limits.Switch(block, thread_id=-1, started=0.0, budget_s=1.0, why="per switch")
    dog.running[id(switch)] = switch
    monkeypatch.setattr(limits, "_raise_in", lambda thread_id, exception: None)  # it never lands
    assert dog.check(now=1.5) == [switch] and switch.sent
    dog.check(now=3.0)
    assert not ended  # within the grace
    dog.check(now=3.6)
    assert len(ended) == 1 and "request req-9" in ended[0] and "block_stop_grace_s=2" in ended[0]
    assert not dog.sent


def test_the_death_message_uses_an_actors_last_words():
    from nnsight_ray._internal.cluster.liveness import death_cause

    gcs = {"DeathCause": None, "LastWords": "the intervention block of request r ran past its budget\n(1 s)"}
    assert death_cause(gcs) == "the intervention block of request r ran past its budget (1 s)"
    assert death_cause({"DeathCause": None}) == ""
