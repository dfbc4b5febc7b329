"""Merge each finished request's per-rank payloads and hand results to callers.

Pure logic (no Ray calls): ``MergeActor`` in ``deploy.py`` wraps it. The
semantics are nnsight's own, applied to payloads that come from separate
processes: ``merge_collected`` (union across pipeline stages, the earliest
rank's value where tensor-parallel ranks report the same registered name,
per-sequence values for ``n > 1``, the first error) and ``attach`` (``saves``,
``nnsight_saves``, ``nnsight_error``, ``outputs[i].saves``,
``nnsight_sequences``). A trace's ``{name: value}`` result is assembled by
nnsight's own ``VLLM._collect`` run over stand-in mediators, so a non-blocking
ref resolves to exactly what a blocking trace pushes into the caller's frame.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


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


def merge_request(output: Any, request_id: str, payloads: list[bytes | None]) -> Any:
    """Attach a finished request's merged saves (ranks' payloads in rank order) to its output."""
    from nnsight.modeling.vllm.engines.engine import attach, merge_collected

    entry = merge_collected([p for p in payloads if p]).get(request_id)
    if output is None:
        return None
    if entry is None:
        entry = {"saves": {}, "error": None, "registered": {}, "sequences": {}}
    attach(output, entry)
    return output


def trace_result(outputs: list[Any], presaved: set[str]) -> dict[str, Any]:
    """``{"saves": {name: value}, "error": deferred-or-None}`` for one trace.

    Runs nnsight's ``VLLM._collect`` (shared-save merging, one value vs a list
    per name, first real error) over stand-in mediators that carry only what it
    reads: ``presaved`` and a scope to write into.
    """
    from nnsight.intervention.errors import capture_exception
    from nnsight.modeling.vllm.vllm import VLLM

    from nnsight.tracing.tracer import _saves

    stand_in = SimpleNamespace(presaved=set(presaved), lcls={})
    error = None
    try:
        VLLM._collect([stand_in], outputs)
    except BaseException as exception:  # a deferred intervention error, re-raised by _collect
        error = capture_exception(exception)
    finally:
        # `_collect` marks values in this thread's saved-id set, the gate a
        # trace's push consults; nothing traces here, so keep it from growing.
        _saves().clear()
    return {"saves": dict(stand_in.lcls), "error": error}
