"""Client-side helper: a non-blocking ``serve=`` trace for nnsight 0.8.1.

nnsight 0.8.1's ``model.trace(..., serve=url)`` is blocking only: ``VLLM.trace``
installs ``LocalServeBackend``, which has no non-blocking mode, and the
``blocking=`` argument (NDIF's ``remote=`` option) is silently ignored when
``serve=`` is given, so ``blocking=False`` still waits and there is no
``tracer.collect()``. This backend is nnsight's own ``LocalServeBackend`` (same
serialization, headers, error re-raising) whose HTTP round trip runs on a
thread instead, so the ``with`` block exits at once::

    from nnsight_ray.serve.client import NonBlockingServe

    with model.trace("Hello", backend=NonBlockingServe(model, url, api_key=key)) as tracer:
        hidden = model.model.layers[2].output[0].save()
    ...                                   # the trace runs on the server meanwhile
    saves = tracer.collect()              # {"hidden": tensor}; re-raises the trace's error
    saves = tracer.collect(timeout=30)    # concurrent.futures.TimeoutError if not done

As with ``RayVLLM``'s ``blocking=False``, the saved values are *not* pushed into
the caller's variables (the block has long exited when they arrive): read them
from ``tracer.collect()``. ``tracer.future`` is the underlying
``concurrent.futures.Future``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from nnsight.modeling.vllm.serve.backend import LocalServeBackend

__all__ = ["NonBlockingServe"]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="nnsight-serve")
        return _pool


class NonBlockingServe(LocalServeBackend):
    """``LocalServeBackend`` that returns at once; results via ``tracer.collect()``."""

    def __call__(self, tracer: Any) -> None:
        from nnsight.schema.request import RequestModel

        # Serialized here, while the trace's frame is still the caller's.
        blob = RequestModel.serialize(tracer, compress=False)
        future: Future = _executor().submit(self._send, blob)
        tracer.future = future
        tracer.collect = lambda timeout=None: future.result(timeout)
