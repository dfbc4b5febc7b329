"""Async streaming traces on a RayVLLM (``mode="async"``), with nnsight's async semantics.

nnsight's ``AsyncVLLMBackend`` streams a trace's ``RequestOutput`` per step out
of an in-process ``AsyncLLM``. Here the engine is an actor, so the carrier is a
Ray streaming generator (``EngineActor.stream``, ``num_returns="streaming"``):
each step's output is yielded as the engine produces it. The contract is
nnsight's:

* ``async for output in tracer.backend`` yields every step; each output has a
  ``saves`` dict and only the finished one is non-empty (``output.saves``, and
  ``output.outputs[i].saves`` for ``n > 1``); a failed intervention is re-raised
  (typed, see ``errors.intervention_error``).
* ``await tracer.backend`` drains and returns the finished output.
* The stream is consumed once: a second ``await`` returns ``None``.
* Closing the stream early (``aclose()``, or breaking out and letting it be
  collected) cancels the generator task; the engine actor's ``finally`` aborts
  the request and winds its workers up on every rank, so nothing leaks.

Saved values never ride the stream: the finished output's saves come from the
merge actor, like every other result.
"""

from __future__ import annotations

from typing import Any

from nnsight.tracing.backend import Backend

from ._internal.cluster.ray_errors import call_errors


class RayStreamBackend(Backend):
    """Backend for a trace on an async ``RayVLLM``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._group: str | None = None
        self._generator: Any = None
        self._consumed = False

    def __call__(self, tracer: Any) -> None:
        """Build the block, serialize it onto the request, start the stream (on ``__exit__``)."""
        interleaver = self.model.interleaver
        try:
            _, (prompts, params, loras), forward_kwargs = tracer.prepare(tracer.info.code)
            if len(prompts) != 1:
                raise NotImplementedError(
                    "a streaming trace takes a single prompt (one invoke or a direct input); "
                    "use a blocking or non-blocking trace for several invokes."
                )
            self.model._attach_mediators(params, **forward_kwargs)
            lora = loras[0] if loras else None
            self._group, self._generator = self.model.vllm_entrypoint.stream(prompts[0], params[0], lora)
        finally:
            interleaver.cancel()

    async def __aiter__(self):
        import ray

        from .errors import raise_intervention

        if self._consumed or self._generator is None:
            return
        self._consumed = True
        finished = False
        engine = self.model.vllm_entrypoint
        try:
            async for ref in self._generator:
                try:
                    output = await ref
                except call_errors() as error:
                    # what died, named as every other caller of the deployment hears it
                    raise engine.unwrap(error) from None
                if output.finished:
                    finished = True
                    output = await engine.finished_output(self._group)
                    raise_intervention(getattr(output, "nnsight_error", None))
                else:
                    output.saves = {}
                yield output
        finally:
            if not finished:
                # Cancel the engine actor's generator: its `finally` aborts the
                # request and frees the workers on every rank.
                ray.cancel(self._generator)

    def __await__(self):
        async def drain():
            last = None
            async for output in self:
                last = output
            return last

        return drain().__await__()
