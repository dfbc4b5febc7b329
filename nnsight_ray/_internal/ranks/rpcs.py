"""RPC entry points every nnsight_ray rank answers, on any platform.

Mixed into the CPU and GPU worker classes (see ``platform.worker_cls``).

``nnsight_ray_describe`` reports where a rank runs. ``nnsight_ray_stash`` is
the distributed form of nnsight's ``collect_nnsight``: the engine calls it
through ``collective_rpc`` when requests finish, and each rank *keeps* what
it collected in this process instead of returning it through vLLM's message
queues. The merge actor then takes each payload straight from the rank actor
(``NNsightRankProc.take_payloads``, on a second actor thread, which is where it
is pickled), so saved tensors travel rank -> object store -> merge actor ->
caller and never pass through the engine core or the engine actor, and the
collective, during which vLLM's engine core runs no step, does no pickling.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
import time
from collections import OrderedDict
from typing import Any

# Payloads not taken within this many seconds are dropped (their merge actor
# is gone); bounded so a lost merge never grows a rank's memory forever.
STASH_TTL_S = float(os.environ.get("NNSIGHT_RAY_STASH_TTL_S", "900"))

# In arrival order, so expiry looks at the oldest entries only (a put is O(1) amortized).
_stash: OrderedDict[str, tuple[float, Any]] = OrderedDict()
_lock = threading.Lock()


def stash_put(request_id: str, payload: Any) -> None:
    now = time.monotonic()
    with _lock:
        _stash.pop(request_id, None)
        _stash[request_id] = (now, payload)
        while _stash:
            oldest, (at, _) = next(iter(_stash.items()))
            if now - at <= STASH_TTL_S:
                break
            del _stash[oldest]


def stash_take(request_ids: list[str]) -> list[Any]:
    """Remove and return what was stashed for ``request_ids`` (None where there is nothing)."""
    with _lock:
        return [(_stash.pop(rid, (0.0, None)))[1] for rid in request_ids]


def take_serialized(request_ids: list[str]) -> list[Any]:
    """The payloads of ``request_ids``, packed now, on the taker's thread (the merge actor's call): each a
    ``payload.Shipped`` (or bytes: no tensor, or an error payload; None where nothing was stashed).

    The stash keeps each request's collected entry as it is (saved values still
    where the forward left them, on the device): pickling, and the copy off the
    device (one per dtype for all of these requests: ``payload.ship_each``),
    happen here, off the engine's critical path, instead of inside the
    collective ``nnsight_ray_stash``, during which vLLM's engine core runs no step.
    The tensors' bytes go out of band, straight into Ray's object store.
    """
    from ..merge.payload import dumps, ship_each

    entries = stash_take(request_ids)
    batch = [i for i, entry in enumerate(entries) if isinstance(entry, dict)]
    results = ship_each([{request_ids[i]: entries[i]} for i in batch])
    for i, result in zip(batch, results):
        entries[i] = _failed(request_ids[i], entries[i], result, dumps) if isinstance(result, Exception) else result
    return entries


def stash_size() -> int:
    with _lock:
        return len(_stash)


def serialize_entry(request_id: str, entry: dict[str, Any], dumps: Any) -> bytes:
    """One request's collect payload; if it cannot be pickled, a payload carrying that error instead.

    Each request is pickled on its own, so a value that cannot travel fails
    only the request that saved it: its batch-mates' payloads are untouched.
    The error names the value (``saves['name']``) and why.
    """
    try:
        return dumps({request_id: entry})
    except Exception as exception:
        return _failed(request_id, entry, exception, dumps)


def _failed(request_id: str, entry: dict[str, Any], exception: Exception, dumps: Any) -> bytes:
    """The payload of a request whose entry could not be pickled: its error, naming the value and why."""
    culprit = _unserializable(entry, dumps)
    message = (f"could not serialize {culprit} of request {request_id} to send it home: "
               f"{type(exception).__name__}: {exception}. Save tensors, numbers, strings and "
               "containers of them (convert other objects before .save()).")
    failed = {"saves": {}, "registered": {}, "sequences": {},
              "error": {"type_name": "TypeError", "message": message, "traceback": "", "is_control_flow": False}}
    return dumps({request_id: failed})


def _unserializable(entry: dict[str, Any], dumps: Any) -> str:
    """Which saved value of ``entry`` cannot be pickled, as ``saves['name']`` (best effort)."""
    places = [("saves", entry.get("saves") or {}), ("registered", entry.get("registered") or {})]
    for index, sequence in (entry.get("sequences") or {}).items():
        places += [(f"sequences[{index}].saves", sequence.get("saves") or {}),
                   (f"sequences[{index}].registered", sequence.get("registered") or {})]
    for where, values in places:
        for name, value in values.items():
            try:
                dumps(value)
            except Exception:
                return f"the saved value {where}[{name!r}] ({type(value).__name__})"
    return "a saved value"


def parked_on_result(runner: Any, request_ids: list[str]) -> set[str]:
    """Which of ``request_ids`` have a block parked on the run's result (``tracer.result``) on this rank.

    nnsight serves a finished request's ``RequestOutput`` only to a block whose
    pending read is ``"result"`` (``serve_result``); every other block is
    collected without it. Keyed as the engine asked (``Request.key``).
    """
    requests = getattr(getattr(runner, "nnsight_requests", None), "requests", None)
    if not requests:
        return set()
    wanted = set(request_ids)
    parked = set()
    for request in list(requests.values()):
        mediator = request.mediator
        pending = getattr(mediator, "pending", None) if mediator is not None else None
        if getattr(pending, "provider", None) == "result" and mediator.alive and request.named(wanted):
            parked.add(request.key(wanted)[0])
    return parked & wanted


class RankRPCMixin:
    """Describe this rank; collect finished requests into the rank-local stash."""

    def nnsight_ray_describe(self) -> dict[str, Any]:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        info: dict[str, Any] = {
            "rank": self.rank,
            "pp_rank": get_pp_group().rank_in_group,
            "tp_rank": get_tp_group().rank_in_group,
            "pid": os.getpid(),
            "gc_frozen": gc.get_freeze_count(),  # vLLM freezes a worker's heap after its warm-up
            "node_id": None,
            "actor_name": None,
            "actor_id": None,
        }
        try:
            import ray

            if ray.is_initialized():
                ctx = ray.get_runtime_context()
                info["node_id"] = ctx.get_node_id()
                info["actor_name"] = ctx.get_actor_name()
                info["actor_id"] = ctx.get_actor_id()
        except Exception:  # not under Ray (multiprocessing executor)
            pass
        return info

    def nnsight_ray_stash(self, request_ids: list[str], outputs: bytes | None = None, mode: str = "all") -> list[str]:
        """Collect each finished request on this rank and keep its entry here, unserialized.

        ``outputs`` is a pickled ``{request_id: RequestOutput}`` for serving
        ``tracer.result`` (absent for aborted requests, which are only wound
        up). The merge actor takes the entries, serialized on its own call
        (``take_serialized``): the engine core, blocked for this collective,
        waits for nnsight's collect only.

        ``mode``: ``"all"`` collects every request; ``"defer"`` (the engine's
        first call, which sends no outputs) collects all but those whose block is
        parked on ``tracer.result``, and returns those; ``"results"`` (its second
        call, with their outputs) collects what this rank deferred. So a trace
        whose blocks never read the result pickles no ``RequestOutput`` to the
        ranks (``EngineCore._collect``). Returns the requests deferred.
        """
        from ..blocks import snapshot
        from ..merge.payload import dumps, unserialized

        # Values kept for later pickling must be ones no later step writes: true of
        # snapshots (the default); with snapshots off, pickle now, as before.
        later = snapshot.enabled()
        waiting: set[str] = self.__dict__.setdefault("_nnsight_ray_waiting", set())
        deferred: set[str] = set()
        if mode == "defer":
            deferred = parked_on_result(self.model_runner, request_ids)
            waiting.update(deferred)
            request_ids = [rid for rid in request_ids if rid not in deferred]
        elif mode == "results":  # only what this rank deferred: the first call stashed the rest
            request_ids = [rid for rid in request_ids if rid in waiting]
            waiting.difference_update(request_ids)
        finished = pickle.loads(outputs) if outputs else {}
        # One collect for the batch (nnsight keys its result by request), then one
        # entry per request: each request's merge may run on another merge actor.
        with unserialized():
            collected = self.collect_nnsight(request_ids, request_ids, finished or None) if request_ids else {}
        for rid in request_ids:
            entry = collected.get(rid) if collected else None
            if entry is None:
                stash_put(rid, b"")
            else:
                stash_put(rid, entry if later else serialize_entry(rid, entry, dumps))
        return sorted(deferred)

    def nnsight_ray_stash_size(self) -> int:
        return stash_size()

    def nnsight_ray_step_modes(self) -> dict[str, int]:
        """How this rank's steps ran: ``graph``, ``piecewise``, ``eager_for_block``, ``eager`` (``graphs.StepModes``)."""
        modes = getattr(self.model_runner, "nnsight_ray_step_modes", None)
        return dict(modes.counts) if modes is not None else {}

    def nnsight_ray_step_timeline(self, since: float = 0.0) -> list[tuple]:
        """This rank's steps that began at ``since`` (``time.monotonic``) or later (``timeline``)."""
        from ..observe.timeline import with_gc

        modes = getattr(self.model_runner, "nnsight_ray_step_modes", None)
        return with_gc(modes.timeline.since(since) if modes is not None else [], since)

    def nnsight_ray_extract_memory(self) -> dict[str, Any]:
        """What this rank holds for activation extraction (``extract.capture.memory``)."""
        from ..extract.capture import memory

        return memory()

    def nnsight_ray_extract_staging(self, mode: str | None = None) -> str:
        """Where this rank's captured rows wait (``host_memory``): the current staging, or switch to
        ``mode`` (refused while rows are held: ``extract.capture.set_staging``)."""
        from ..extract.capture import set_staging, writer

        return writer().staging if mode is None else set_staging(mode)

    def nnsight_ray_block_names(self) -> dict[str, int]:
        """How many source-cache entries of received blocks this rank holds (a leak gauge; see ``block_names``)."""
        from ..blocks.block_names import held

        return held(self.model_runner)

