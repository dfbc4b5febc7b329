"""Non-blocking traces on a RayVLLM (``trace(..., blocking=False)``), through nnsight's backend seam.

nnsight's default backend builds a trace's workers, runs the model interleaved
and pushes the saves into the caller's frame before ``with`` exits. A
``RayRefBackend`` does the first half the same way (``VLLMTracer.prepare``,
then nnsight's own ``_attach_mediators``), submits the requests to the
deployment and returns at once; the merge actor assembles the trace's
``{name: value}`` with nnsight's ``VLLM._collect`` (``merge.book.trace_saves``).

* ``tracer.ref``: an ``ObjectRef`` to ``{name: value}``. Pass it to tasks and
  actors like any ref. When an intervention raised, ``ray.get`` raises Ray's
  task error, which is an instance of the intervention's exception type.
* ``tracer.collect(timeout=None)``: the same dict, waited for without ever
  hanging on a dead deployment (``RemoteEngine.wait``); raises the
  intervention's own typed error, as a blocking trace does.
* ``trace(blocking=False, outputs=True)``: the ref (and ``collect()``) is
  ``(dict, outputs)``, each invoke's prompt token ids, generated token ids
  and text from its finished request (``merge.book.request_summary``).

The variables saved in the block are not assigned in the caller's frame (there
is nothing to assign yet): read the values from the dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nnsight.tracing.backend import Backend

from .errors import RequestError

__all__ = ["BuiltTrace", "RayRefBackend", "build", "no_ref"]


@dataclass
class BuiltTrace:
    """A trace's requests, blocks attached, ready to submit: one request per invoke."""

    prompts: list[Any]
    params: list[Any]
    loras: list[Any] | None
    presaved: set[str]


def build(model: Any, tracer: Any) -> BuiltTrace:
    """The first half of nnsight's ``VLLMTracer.execute``: build the workers, attach them to the requests.

    Used by every path that submits a trace instead of running it here (a
    non-blocking trace, the Serve replica's ``/v1/nnsight/generate``). Whether
    or not it succeeds, nothing is left behind: as nnsight's own execute does
    on its way out, the interleaver's workers and the shared store are cleared.
    """
    from nnsight.intervention.util import clear_shared_locals

    try:
        _, (prompts, params, loras), forward_kwargs = tracer.prepare(tracer.info.code)
        mediators = model._attach_mediators(params, **forward_kwargs)
        presaved: set[str] = set()
        for mediator in mediators:
            presaved |= set(getattr(mediator, "presaved", ()) or ())
        return BuiltTrace(list(prompts), list(params), list(loras) if loras else None, presaved)
    finally:
        model.interleaver.cancel()
        clear_shared_locals()


class RayRefBackend(Backend):
    """Backend for ``trace(..., blocking=False)`` on a ``RayVLLM``."""

    def __init__(self, model: Any, outputs: bool = False) -> None:
        self.model = model
        self.outputs = outputs
        self.ref: Any = None

    def __call__(self, tracer: Any) -> None:
        built = build(self.model, tracer)
        extra = {"outputs": True} if self.outputs else {}
        self.ref = self.model.vllm_entrypoint.trace_ref(built.prompts, built.params, built.loras, built.presaved,
                                                        **extra)
        tracer.ref = self.ref
        tracer.collect = self.collect

    def collect(self, timeout: float | None = None) -> dict[str, Any]:
        if self.ref is None:
            raise RequestError("this trace has no result reference yet: it has not exited")
        return self.model.vllm_entrypoint.wait(self.ref, timeout)


def _blocking_collect(timeout: float | None = None) -> dict[str, Any]:
    raise RequestError("this trace was blocking: its values are in the variables it saved, "
                       "not behind a reference (trace(..., blocking=False) gives one)")


def no_ref(tracer: Any) -> Any:
    """A blocking trace's ``tracer.ref`` / ``tracer.collect()``: there is none; say so.

    A module function, not a closure: a block that names ``tracer`` (``tracer.all()``) pickles the
    tracer into every invoke's request, and a closure travels as its source, re-read each time.
    """
    tracer.ref = None
    tracer.collect = _blocking_collect
    return tracer
