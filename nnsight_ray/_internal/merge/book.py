"""Merge each finished request's per-rank payloads and hand results to callers.

Pure logic (no Ray calls): ``MergeActor`` in ``deploy/actors.py`` is a shell over
``MergeBook`` (groups, waiting, expiry, death), which it feeds with what it
takes from the ranks. The
semantics are nnsight's own, applied to payloads that come from separate
processes: ``merge_collected`` (union across pipeline stages, the earliest
rank's value where tensor-parallel ranks report the same registered name,
per-sequence values for ``n > 1``, the first error) and ``attach`` (``saves``,
``nnsight_saves``, ``nnsight_error``, ``outputs[i].saves``,
``nnsight_sequences``). A trace's ``{name: value}`` result is assembled by
nnsight's own ``VLLM._collect`` run over stand-in mediators, so a non-blocking
ref resolves to exactly what a blocking trace pushes into the caller's frame,
and raises what a blocking trace raises.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ...errors import EngineDeadError


@dataclass
class Group:
    """The requests of one call (a trace's invokes, or one plain generate batch).

    ``size`` is 0 until the caller's wait arrives and says how many to expect.
    """

    size: int
    outputs: dict[int, Any] = field(default_factory=dict)
    error: BaseException | None = None
    created: float = field(default_factory=time.monotonic)
    # When a request of the group last reported.
    finished: float | None = None

    @property
    def complete(self) -> bool:
        return self.error is not None or (self.size > 0 and len(self.outputs) >= self.size)

    def expired(self, now: float, waited: bool, abandon_after_s: float, ttl_s: float) -> bool:
        """Drop a group nobody waits for: its caller died before asking for it.

        Callers ask for a group's result at submit time, so a group whose
        requests reported ``abandon_after_s`` ago and that still has no waiter
        belongs to a caller that is gone. Anything older
        than ``ttl_s`` goes regardless.
        """
        if waited:
            return False
        if self.finished is not None and now - self.finished > abandon_after_s:
            return True
        return now - self.created > ttl_s

    def ordered(self) -> list[Any]:
        return [self.outputs[i] for i in range(self.size)]


class MergeBook:
    """One merge actor's groups: what has arrived, who waits for what, expiry, and death.

    ``fail(message)`` is the way out for every waiter: the engine (or the merge
    actor's own watch on the engine actor) declares the deployment dead, every
    group still incomplete fails with ``EngineDeadError(message)``, and every
    later wait fails at once with the same message.
    """

    def __init__(self, abandon_after_s: float, ttl_s: float) -> None:
        self.abandon_after_s = abandon_after_s
        self.ttl_s = ttl_s
        self.groups: dict[str, Group] = {}
        self.waiters: dict[str, asyncio.Event] = {}
        self.dead: str | None = None
        self._died = asyncio.Event()  # set by fail()
        self.bytes_merged = 0
        self.requests_merged = 0  # finished requests handed over by the engine
        self.groups_expired = 0  # dropped by the sweep: caller gone, or never came for them

    def group(self, key: str) -> Group:
        return self.groups.setdefault(key, Group(size=0))

    def arrive(self, reports: list[Any], per_rank: list[list[bytes | None]],
               failure: BaseException | None = None) -> None:
        """Merge finished requests (``engine.core.Report``s); ``per_rank[r][i]``: rank r's payload of report i."""
        now = time.monotonic()
        for position, report in enumerate(reports):
            payloads = [taken[position] for taken in per_rank]
            self.bytes_merged += sum(getattr(p, "nbytes", None) or len(p) for p in payloads if p)
            self.requests_merged += 1
            state = self.group(report.group)
            error = report.error or failure
            if error is None:
                try:
                    state.outputs[report.index] = merge_request(report.output, report.request_id, payloads)
                except Exception as exception:  # a payload that cannot be read fails its own group only
                    error = exception
            if error is not None:
                state.error = state.error or error
            state.finished = now  # last activity: see Group.expired
            self._wake(report.group)

    def _wake(self, key: str) -> None:
        event = self.waiters.get(key)
        if event is not None:
            event.set()

    async def wait(self, key: str, size: int) -> Group:
        """The group once all ``size`` requests arrived (or it failed); it is then forgotten."""
        if self.dead is not None and key not in self.groups:
            raise EngineDeadError(self.dead)
        state = self.group(key)
        state.size = size
        event = self.waiters.setdefault(key, asyncio.Event())
        try:
            while not state.complete:
                event.clear()
                await event.wait()
        finally:
            self.waiters.pop(key, None)
            self.groups.pop(key, None)
        return state

    async def death(self, timeout: float) -> str | None:
        """The death message once ``fail`` is called (at once if it was), or None after ``timeout`` s."""
        if self.dead is None:
            try:
                await asyncio.wait_for(self._died.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.dead

    def fail(self, message: str) -> None:
        """The deployment is dead: fail every incomplete group now, and every later wait."""
        if self.dead is not None:
            return
        self.dead = message
        self._died.set()
        for key, state in self.groups.items():
            if not state.complete:
                state.error = EngineDeadError(message)
            self._wake(key)

    def sweep(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for key, state in list(self.groups.items()):
            if state.expired(now, key in self.waiters, self.abandon_after_s, self.ttl_s):
                del self.groups[key]
                self.groups_expired += 1

    def stats(self) -> dict[str, Any]:
        self.sweep()
        return {"groups": len(self.groups), "waiting": len(self.waiters), "bytes_merged": self.bytes_merged,
                "requests_merged": self.requests_merged, "groups_expired": self.groups_expired,
                "dead": self.dead}


def merge_request(output: Any, request_id: str, payloads: list[Any]) -> Any:
    """Attach a finished request's merged saves (ranks' payloads in rank order: bytes, or
    ``payload.Arrived``) to its output."""
    from nnsight.modeling.vllm.engines.engine import attach, merge_collected

    from .payload import arrived

    present = [p for p in payloads if p]
    with arrived(present):  # nnsight loads each payload; a shipped one's tensors arrived beside it
        entry = merge_collected(present).get(request_id)
        if entry is not None and len(present) > 1:
            merge_caches(entry, request_id, present)
    if output is None:
        return None
    if entry is None:
        entry = {"saves": {}, "error": None, "registered": {}, "sequences": {}}
    attach(output, entry)
    return output


def _cache_views(saves: dict) -> list[str]:
    from nnsight.intervention.cache import CacheView

    return [name for name, value in saves.items() if isinstance(value, CacheView)]


def merge_caches(entry: dict, request_id: str, payloads: list[Any]) -> None:
    """Give every ``tracer.cache()`` of a request the modules of every rank, as one device records them.

    ``merge_collected`` keeps one rank's value per saved name (the last one's), which for a
    ``CacheView`` is one pipeline stage's modules only: each stage's ``Cache`` records the
    modules that ran there. Here each view's ``Cache.entries`` becomes the union over the
    ranks in rank order (stage 0's layers first, as the forward reached them); a module
    recorded by several ranks (tensor-parallel peers, equal values; the model and its
    containers, called on every stage) keeps the latest rank's visits, the last stage's
    being the model's real output. Payloads are read again only when a request saved a cache.
    """
    import copy
    import pickle

    where = [("saves", None, entry["saves"])] + [
        ("sequences", index, sequence["saves"]) for index, sequence in (entry.get("sequences") or {}).items()]
    wanted = [(kind, index, name) for kind, index, saves in where for name in _cache_views(saves)]
    if not wanted:
        return
    merged: dict[tuple, dict] = {key: {} for key in wanted}
    for payload in payloads:
        mine = pickle.loads(payload).get(request_id) or {}
        for kind, index, name in wanted:
            saves = mine.get("saves") if kind == "saves" else \
                ((mine.get("sequences") or {}).get(index) or {}).get("saves")
            view = (saves or {}).get(name)
            if view is not None and hasattr(view, "_cache"):
                into = merged[(kind, index, name)]
                for path, visits in view._cache.entries.items():
                    into.pop(path, None)
                    into[path] = visits
    for (kind, index, name), entries in merged.items():
        saves = entry["saves"] if kind == "saves" else entry["sequences"][index]["saves"]
        view = saves[name]
        cache = copy.copy(view._cache)
        cache.entries = entries
        saves[name] = type(view)(cache, view._envoy, view._path)


def request_summary(output: Any) -> dict[str, Any]:
    """What a caller reads of a finished request without a block waiting on ``tracer.result``: its prompt's
    token ids and its first completion's token ids and text (vLLM's ``RequestOutput``)."""
    completion = output.outputs[0] if output is not None and output.outputs else None
    return {"prompt_token_ids": list(output.prompt_token_ids or []) if output is not None else [],
            "token_ids": list(completion.token_ids) if completion is not None else [],
            "text": completion.text if completion is not None else ""}


def trace_saves(outputs: list[Any], presaved: set[str]) -> dict[str, Any]:
    """One trace's ``{name: value}``, as a blocking trace pushes it into the caller's frame.

    Runs nnsight's ``VLLM._collect`` (shared-save merging, one value vs a list
    per name, first real error) over stand-in mediators that carry only what it
    reads: ``presaved`` and a scope to write into. When an intervention raised,
    raises it: the request's own deferred error, typed as a blocking trace
    raises it (``errors.intervention_error``), not the RuntimeError ``_collect``
    wrapped it in.
    """
    from nnsight.modeling.vllm.vllm import VLLM

    from nnsight.tracing.tracer import _saves

    from ...errors import raise_intervention

    stand_in = SimpleNamespace(presaved=set(presaved), lcls={})
    try:
        VLLM._collect([stand_in], outputs)
    except BaseException:  # a deferred intervention error, re-raised by _collect
        deferred = [e for e in (getattr(o, "nnsight_error", None) for o in outputs)
                    if e and not e.get("is_control_flow")]
        if not deferred:
            raise
        raise_intervention(deferred[0])  # always raises: control-flow stops were filtered out
        raise
    finally:
        # `_collect` marks values in this thread's saved-id set, the gate a
        # trace's push consults; nothing traces here, so keep it from growing.
        _saves().clear()
    return dict(stand_in.lcls)
