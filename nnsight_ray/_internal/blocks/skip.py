"""A traced ``with`` block's body is skipped by ``sys.monitoring`` on Python 3.12+, not by ``sys.settrace``.

Problem (nnsight 0.8.1, Python 3.12+). nnsight runs a block's body itself, so
``Tracer.__enter__`` stops the body from running inline (``skip_context``): it
sets a global ``sys.settrace`` no-op and a trace function on the caller's frame
that raises at the body's first line; ``Tracer.__exit__`` sets the thread's
tracer back. From Python 3.12 ``sys.settrace`` rides on ``sys.monitoring``:
turning it on and off changes the interpreter's instrumentation version, and
every function that runs afterwards is re-instrumented the first time it runs.
A trace of 256 invokes toggles it 257 times: on the 2-core machine the invokes'
capture took 16.4 ms under Python 3.12 against 3.2 ms under 3.11 (a tiny Llama,
``LanguageModel``), and on the GPU hosts (Python 3.12) a 256-invoke trace spent
28-47 ms in the caller before its attach where the CPU host (3.11) spends 5-6.

Design. ``SkipTracer`` (nnsight's ``VLLMTracer``, the ``tracer_cls`` seam of
``Envoy.trace``) and its ``SkipInvoker`` (``tracer.invoke``) skip the body with
a ``LINE`` event local to the caller's code object (``sys.monitoring.set_local_events``,
a tool id of nnsight_ray's own): only that code object is instrumented, and
nothing else is re-instrumented (4.6 ms for the same 256 invokes; ``benchmarks.invoke_capture``). The callback
raises nnsight's ``ExitTracingException`` in the armed frame only (other frames
running the same code, in other threads or recursion, go on), carrying the
thread's tracer unchanged, so nnsight's ``__exit__`` runs the body through the
backend exactly as before; ``__exit__`` also disarms a frame whose body was never
reached. A body nnsight cannot intercept is refused with nnsight's reasons (it
starts on the ``with`` line, or with ``try:``). Where ``sys.monitoring`` is
missing (Python 3.11), its tool ids are all taken, or ``NNSIGHT_RAY_MONITORED_SKIP=0``,
``tracer_cls`` gives None and a trace runs nnsight's own tracer, unchanged.
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType
from typing import Any

from nnsight.intervention.tracer import Invoker
from nnsight.modeling.vllm.tracer import VLLMTracer
from nnsight.tracing.tracer import TRY_STATEMENTS, ExitTracingException, skip_context, skippable

ENV = "NNSIGHT_RAY_MONITORED_SKIP"
TOOL_NAME = "nnsight_ray.skip"
# sys.monitoring's free tool ids (0 debugger, 1 coverage, 2 profiler, 5 optimizer are spoken for).
TOOL_IDS = (3, 4)

_lock = threading.Lock()
# frame -> (the body's first line, the thread's tracer when armed)
_armed: dict[FrameType, tuple[int, Any]] = {}
_tool: int | None = None
_claimed = False


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def tracer_cls() -> type | None:
    """``SkipTracer`` where its skip can run (Python 3.12+, a free tool id, not turned off), else None:
    nnsight's own tracer then, unchanged."""
    return SkipTracer if enabled() and _claim() is not None else None


def _claim() -> int | None:
    """nnsight_ray's ``sys.monitoring`` tool id (claimed once per process), or None where there is none."""
    global _tool, _claimed
    if _claimed:
        return _tool
    with _lock:
        if not _claimed:
            _claimed = True
            monitoring = getattr(sys, "monitoring", None)
            for tool in TOOL_IDS if monitoring is not None else ():
                try:
                    monitoring.use_tool_id(tool, TOOL_NAME)
                except ValueError:  # another tool holds it
                    continue
                monitoring.register_callback(tool, monitoring.events.LINE, _line)
                _tool = tool
                break
        return _tool


def _line(code: Any, lineno: int) -> Any:
    frame = sys._getframe(1)  # the frame whose line this is
    entry = _armed.get(frame)
    if entry is None or lineno < entry[0]:  # another frame running this code, or still in the header
        return None
    _disarm(frame)
    raise ExitTracingException(entry[1])


def _disarm(frame: FrameType | None) -> None:
    if frame is None or _tool is None:
        return
    with _lock:
        if _armed.pop(frame, None) is not None and not any(f.f_code is frame.f_code for f in _armed):
            sys.monitoring.set_local_events(_tool, frame.f_code, 0)


def arm(tracer: Any) -> bool:
    """Skip ``tracer``'s body by a local ``LINE`` event on its frame; False where nnsight's skip must run."""
    tool = _claim()
    if tool is None:
        return False
    node, frame = tracer.node, tracer.info.frame
    body = node.body[0].lineno
    # nnsight's two refusals (``skip_context``): a raise can only land at the start of a line, and
    # one delivered on a leading ``try`` unwinds the whole frame past the ``with``.
    if body == node.lineno:
        raise ValueError("The body of a traced `with` must start on its own line; nnsight runs "
                         "the body itself, and can only intercept it at the start of a line.")
    if isinstance(node.body[0], TRY_STATEMENTS):
        raise ValueError("A traced `with` block cannot start with `try:`; nnsight intercepts the body at its "
                         "first line, and a `try` there is the one statement Python gives it no way back out "
                         "of. Put any statement above the `try`, or move the `try` outside the block.")
    with _lock:
        _armed[frame] = (body, sys.gettrace())
        sys.monitoring.set_local_events(tool, frame.f_code, sys.monitoring.events.LINE)
    return True


class _MonitoredSkip:
    """``Tracer.__enter__`` / ``__exit__`` with the body skipped by ``arm`` (nnsight's skip where it cannot)."""

    def __enter__(self) -> Any:
        self.capture()  # nnsight's: the caller's frame is two up from here, as from Tracer.__enter__
        if skippable(self.node) and not arm(self):
            skip_context(self)
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, exc_traceback: Any) -> bool:
        _disarm(self.info.frame if self.info is not None else None)  # a body never reached
        return super().__exit__(exc_type, exc_value, exc_traceback)  # type: ignore[misc]


class SkipInvoker(_MonitoredSkip, Invoker):
    """nnsight's ``Invoker``, its body skipped by ``arm``."""


class SkipTracer(_MonitoredSkip, VLLMTracer):
    """nnsight's ``VLLMTracer``, its body and its invokes' bodies skipped by ``arm``."""

    def invoke(self, *args: Any, **kwargs: Any) -> Invoker:
        return SkipInvoker(self, *args, **kwargs)
