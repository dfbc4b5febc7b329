"""What one request's block may take from the engine it shares: time on the rank, bytes of saved values.

nnsight 0.8.1 runs each request's block as a greenlet on the thread that runs
the model (``nnsight.intervention.interleaver``): the model side switches into
the block when the model reaches a location the block waits on, and gets the
thread back only when the block parks on its next location or ends. A block
that never parks (``while True: ...``) holds the forward pass, and with it
every request in the batch. So every switch into a block is timed
(``LimitedMediator``, swapped onto each mediator as its request arrives), and a
watchdog thread per rank process stops a block that runs past its budget.

How a block is stopped: the watchdog raises ``BlockStopped`` in the model's
thread (``PyThreadState_SetAsyncExc``). CPython delivers it at the next
bytecode boundary the block runs, so it stops Python loops, deep recursion and
anything that returns to Python (a ``time.sleep`` when it wakes, a torch op when
it ends); it does not interrupt one C call. ``BlockStopped`` derives from
``BaseException`` so the block's own ``except Exception`` does not swallow it;
on its way out of the block it becomes a ``BlockTimeoutError`` (a ``TimeoutError``) whose message names
the request, the limit and how to raise it, and nnsight's deferred errors end
that request only (the engine's interleaver runs with ``defer_exceptions``):
the other requests of the batch go on with their values.

The one race: the watchdog decides to stop a block just as it parks. Both
sides claim the running switch with one atomic ``dict.pop``; the side that
gets it decides. If the watchdog wins, its exception is on its way and the
model side waits for it inside the switch it is leaving, so it can never land
in vLLM's or nnsight's code outside a switch.

Budgets: ``block_timeout_s`` for one switch (the block's work at one location,
typically one step), ``block_total_timeout_s`` for all of a request's
switches together. The engine sets the defaults and ``max_block_timeout_s``,
the most a request may ask for (``trace(..., block_timeout_s=...)``). Saved
values: a request whose saves come to more than ``max_save_bytes`` on a rank
fails with that limit in its message, and none of its values leave the rank
(``bound_saves``, applied where nnsight's collect serializes).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable

from ...errors import BlockTimeoutError, block_held
from ..blocks.classes import extend

logger = logging.getLogger(__name__)

LIMITS_KEY = "nnsight_ray_limits"  # in vLLM's additional_config (the engine's) and a request's extra_args
ENGINE_KEYS = ("block_timeout_s", "block_total_timeout_s", "max_block_timeout_s", "max_save_bytes", "block_stop_grace_s")
REQUEST_KEYS = ("block_timeout_s", "block_total_timeout_s")
WATCH_PERIOD_S = 0.02  # between looks while a block runs
IDLE_PERIOD_S = 0.2  # between looks while none does: a budget is kept to within this much


class BlockStopped(BaseException):
    """Raised inside a block that ran past its budget (a ``BaseException``: ``except Exception`` lets it pass)."""


@dataclass(frozen=True)
class Limits:
    """An engine's limits on every request's block (defaults for each request, and the most one may ask)."""

    block_timeout_s: float = 30.0
    block_total_timeout_s: float = 300.0
    max_block_timeout_s: float = 600.0
    max_save_bytes: int = 4 << 30
    block_stop_grace_s: float = 30.0

    @classmethod
    def of(cls, values: dict[str, Any] | None) -> "Limits":
        """Limits from an engine's settings; a default the given maximum is below comes down to it."""
        given = {k: v for k, v in (values or {}).items() if k in ENGINE_KEYS}
        for key, value in given.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key}={value!r}: must be a positive number of "
                                 f"{'bytes' if key == 'max_save_bytes' else 'seconds'}")
        top = given.get("max_block_timeout_s", cls.max_block_timeout_s)
        for key in REQUEST_KEYS:
            if key not in given:
                given[key] = min(getattr(cls, key), top)
            elif given[key] > top:
                raise ValueError(f"{key}={given[key]} is above max_block_timeout_s={top}: raise "
                                 f"max_block_timeout_s or lower {key}")
        return cls(**given)

    def for_request(self, asked: dict[str, Any] | None) -> "Limits":
        """The limits of one request that asked for ``asked`` (its ``extra_args[LIMITS_KEY]``); ValueError past the max."""
        changes = {}
        for key, value in (asked or {}).items():
            if key not in REQUEST_KEYS:
                raise ValueError(f"unknown block limit {key!r}; a request may set {list(REQUEST_KEYS)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key}={value!r}: must be a positive number of seconds")
            if value > self.max_block_timeout_s:
                raise ValueError(f"{key}={value} is above this engine's max_block_timeout_s="
                                 f"{self.max_block_timeout_s}; ask its operator, or ask for less")
            changes[key] = float(value)
        return replace(self, **changes)


def engine_limits(kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments with our limit keys moved into ``additional_config`` (validated here, in the caller)."""
    kwargs = dict(kwargs)
    given = {key: kwargs.pop(key) for key in ENGINE_KEYS if key in kwargs}
    limits = Limits.of(given)
    kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), LIMITS_KEY: asdict(limits)}
    return kwargs


def request_limits(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take a trace's limit keywords out of ``kwargs`` (in place): what rides its requests' ``extra_args``."""
    return {key: kwargs.pop(key) for key in REQUEST_KEYS if key in kwargs}


# --------------------------------------------------------------------------- time


class Switch:
    """One switch into a block: who, on which thread, since when, and the budget it has."""

    __slots__ = ("mediator", "thread_id", "started", "budget_s", "why", "where", "sent", "accounted")

    def __init__(self, mediator: Any, thread_id: int, started: float, budget_s: float, why: str) -> None:
        self.mediator = mediator
        pending = getattr(mediator, "pending", None)
        self.where = getattr(pending, "provider", None)  # the location the block was handed, if it was parked
        self.thread_id = thread_id
        self.started = started
        self.budget_s = budget_s
        self.why = why  # which limit the budget is: "per switch" or "in total"
        self.sent = False  # the watchdog claimed it and sent its stop
        self.accounted = False


class Watchdog:
    """Stops blocks that run past their budget; one per process, started with the first limited mediator."""

    def __init__(self, period_s: float = WATCH_PERIOD_S, idle_period_s: float = IDLE_PERIOD_S) -> None:
        self.period_s = period_s
        self.idle_period_s = idle_period_s
        self.running: dict[int, Switch] = {}  # id(switch) -> switch; claimed by one atomic pop
        self.sent: dict[int, tuple[Switch, float]] = {}  # stops sent and not yet received, with when
        self.stopped = 0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="nnsight-ray-block-watchdog", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.period_s if self.running or self.sent else self.idle_period_s)
            try:
                self.check(time.monotonic())
            except Exception:  # never die silently: a watchdog that stops watching is a shared engine at risk
                logger.exception("block watchdog: a check failed; watching on")

    def check(self, now: float) -> list[Switch]:
        """Stop every switch past its budget (claimed here, so its block's side cannot also claim it)."""
        stopped = []
        for key, switch in list(self.running.items()):
            if now - switch.started <= switch.budget_s:
                continue
            if self.running.pop(key, None) is None:  # the block parked first: it is the model side's
                continue
            switch.sent = True  # before the stop can arrive: the block's side reads it to know the stop is its own
            self.sent[key] = (switch, now)
            _raise_in(switch.thread_id, BlockStopped)
            self.stopped += 1
            stopped.append(switch)
        for key, (switch, sent_at) in list(self.sent.items()):
            if switch.accounted:
                self.sent.pop(key, None)
            elif now - sent_at > switch.mediator.nnsight_ray_limits.block_stop_grace_s:
                self.sent.pop(key, None)
                self.give_up(switch, now - sent_at)
        return stopped

    def give_up(self, switch: Switch, waited: float) -> None:
        """A block that does not stop (one C call that never returns to Python): stop this rank, so every waiter is told."""
        mediator = switch.mediator
        limits = mediator.nnsight_ray_limits
        reason = (f"the intervention block of request {mediator.nnsight_ray_request} ran past its budget "
                  f"({switch.budget_s:g} s {switch.why}) and did not stop {waited:.0f} s after it was told to "
                  f"(block_stop_grace_s={limits.block_stop_grace_s:g}): it is stuck in code that cannot be "
                  f"interrupted, such as one long C call; this rank was stopped so that every request is told")
        logger.critical("block watchdog: %s", reason)
        _exit_rank(reason)


def _raise_in(thread_id: int, exception: type[BaseException]) -> None:
    # PyDLL: the call holds the GIL, so it is one step for every other Python thread.
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exception))
    if done != 1:
        logger.error("block watchdog: could not stop thread %s (%s threads matched)", thread_id, done)


def _exit_rank(reason: str) -> None:
    """End this process, leaving ``reason`` where the engine's death message reads it (``liveness.death_cause``)."""
    try:
        import ray

        if ray.is_initialized():
            from ray.experimental import internal_kv

            from ..cluster.liveness import last_words_key
            from ..cluster.placement import NAMESPACE

            actor_id = ray.get_runtime_context().get_actor_id()
            if actor_id:
                internal_kv._internal_kv_put(last_words_key(actor_id), reason.encode(), overwrite=True,
                                             namespace=NAMESPACE)
    except Exception:
        logger.exception("block watchdog: could not leave the reason for the engine; exiting anyway")
    os._exit(1)


WATCHDOG = Watchdog()


class LimitedMediator:
    """Behaviour added to an nnsight ``Mediator`` (class swap): every switch into its block is timed and stoppable."""

    nnsight_ray_limits: Limits
    nnsight_ray_request: str
    nnsight_ray_used_s: float

    def switch(self, *args: Any) -> Any:
        limits = self.nnsight_ray_limits
        left = limits.block_total_timeout_s - self.nnsight_ray_used_s
        per_switch = limits.block_timeout_s <= left
        switch = Switch(self, threading.get_ident(), time.monotonic(), min(limits.block_timeout_s, max(left, 0.0)),
                        "per switch" if per_switch else "in total")
        key = id(switch)
        WATCHDOG.running[key] = switch
        try:
            try:
                result = super().switch(*args)  # type: ignore[misc]
            except BlockStopped:
                raise
            except BaseException:
                self._leave(switch, key)  # a stop may still arrive in here: then it replaces this error
                raise
            self._leave(switch, key)
            return result
        except BlockStopped:
            if not switch.sent:  # an outer block's stop, passing through this nested switch
                WATCHDOG.running.pop(key, None)
                raise
            self._account(switch)
            raise BlockTimeoutError(self._stopped_message(switch)) from None

    def _leave(self, switch: Switch, key: int) -> None:
        """End a switch the block left on its own; if the watchdog claimed it first, wait here for its stop."""
        if WATCHDOG.running.pop(key, None) is not None:
            self._account(switch)
            return
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # the stop is sent: it arrives at the next bytecode boundary here
            time.sleep(0.0005)
        logger.error("block watchdog: a stop sent to request %s never arrived", self.nnsight_ray_request)
        self._account(switch)

    def _account(self, switch: Switch) -> None:
        if not switch.accounted:
            switch.accounted = True
            self.nnsight_ray_used_s += time.monotonic() - switch.started

    def _stopped_message(self, switch: Switch) -> str:
        limits = self.nnsight_ray_limits
        ran = time.monotonic() - switch.started
        if switch.why == "per switch":
            limit = f"block_timeout_s={limits.block_timeout_s:g} (the most a block may run at one location)"
        else:
            limit = (f"block_total_timeout_s={limits.block_total_timeout_s:g} (the most a block may run over its "
                     f"whole request; {self.nnsight_ray_used_s:.1f} s used)")
        where = f"after it was handed {switch.where}" if switch.where else "from its start"
        return (f"request {self.nnsight_ray_request}: {block_held(ran)} "
                f"{where} without giving the model its thread back; the limit is {limit}. Other requests were not "
                f"affected. Raise it per trace with trace(..., block_timeout_s=..., block_total_timeout_s=...) up "
                f"to the engine's max_block_timeout_s={limits.max_block_timeout_s:g}.")


def limit(mediator: Any, limits: Limits, request_id: str) -> None:
    """Time every switch into ``mediator``'s block against ``limits``."""
    extend(mediator, LimitedMediator)
    mediator.nnsight_ray_limits = limits
    mediator.nnsight_ray_request = request_id
    mediator.nnsight_ray_used_s = 0.0


class LimitedRequests:
    """Behaviour added to nnsight's ``Requests`` (class swap): each new request's blocks get its limits."""

    nnsight_ray_limits: Limits

    def add(self, new_requests: Any, persistent_objects: dict) -> None:
        from nnsight.intervention.errors import capture_exception

        fresh = [data for data in new_requests if data.req_id not in self.requests]  # type: ignore[attr-defined]
        super().add(new_requests, persistent_objects)  # type: ignore[misc]
        for data in fresh:
            request = self.requests.get(data.req_id)  # type: ignore[attr-defined]
            if request is None:
                continue
            extra = getattr(data.sampling_params, "extra_args", None) or {}
            try:
                limits = self.nnsight_ray_limits.for_request(extra.get(LIMITS_KEY))
            except ValueError as error:
                request.error = capture_exception(error)
                request.mediator = None
                continue
            for mediator in request.workers():
                limit(mediator, limits, request.stem)


# --------------------------------------------------------------------------- bytes


def saved_bytes(value: Any, seen: set[int] | None = None) -> int:
    """The bytes of every tensor in a saved value (nested lists, tuples, dicts): what its pickle carries.

    Each tensor counts its own elements (nnsight's compact pickle sends a view's elements, not its
    base's), each tensor object once (a request's primary sequence is also its flat entry).
    """
    import torch

    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return 0
        seen.add(id(value))
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(saved_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(saved_bytes(v, seen) for v in value)
    return 0


def bound_saves(collected: dict[str, dict], max_bytes: int) -> dict[str, dict]:
    """``collected`` (nnsight's collect: request id -> entry) with every entry over ``max_bytes`` emptied and failed."""
    from nnsight.intervention.errors import capture_exception

    for request_id, entry in collected.items():
        size = _entry_bytes(entry)
        if size <= max_bytes:
            continue
        error = MemoryError(
            f"request {request_id}: its saved values come to {size / 2**20:,.1f} MiB on this rank, over the engine's "
            f"max_save_bytes={max_bytes:,} ({max_bytes / 2**20:,.1f} MiB); nothing of it was sent. Save less (a "
            f"slice, a reduction, fewer steps), or ask the engine's operator for a larger max_save_bytes.")
        entry["error"] = capture_exception(error)
        for part in _parts(entry):
            part["saves"] = {}
            part["registered"] = {}
    return collected


def _parts(entry: dict) -> Iterable[dict]:
    yield entry
    yield from (entry.get("sequences") or {}).values()


def _entry_bytes(entry: dict) -> int:
    seen: set = set()
    return sum(saved_bytes(part.get("saves"), seen) + saved_bytes(part.get("registered"), seen) for part in _parts(entry))


class LimitsRunnerMixin:
    """Runner mixin: the engine's limits (``additional_config[LIMITS_KEY]``) on every request's block and saves."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        config = getattr(self, "vllm_config", None)  # type: ignore[attr-defined]
        limits = Limits.of(((getattr(config, "additional_config", None) or {}).get(LIMITS_KEY)))
        self.nnsight_ray_limits = limits
        requests = self.nnsight_requests  # type: ignore[attr-defined]
        extend(requests, LimitedRequests)
        requests.nnsight_ray_limits = limits
        WATCHDOG.start()

    def collect_nnsight(self, *args: Any, **kwargs: Any) -> Any:
        from ..merge.payload import collect_filter

        max_bytes = self.nnsight_ray_limits.max_save_bytes
        with collect_filter(lambda collected: bound_saves(collected, max_bytes)):
            return super().collect_nnsight(*args, **kwargs)  # type: ignore[misc]
