"""Saved values are snapshots: the model goes on with its own copy of what a block was handed.

Problem (vLLM 0.32 on CUDA, nnsight 0.8.1): a block is handed the model's own
tensors. nnsight assumes, as PyTorch models mostly allow, that nothing writes
into them afterwards. vLLM's CUDA kernels do: a Llama decoder layer returns
``(hidden, residual)`` and the *next* layer's ``fused_add_rms_norm`` updates
both in place, so ``layers[1].output.save()`` comes home holding layer 2's
values (measured on an H200: 1.07 relative error against transformers;
``docs/gpu.md``). vLLM's CPU kernels are not in place, which is why no CPU test
saw it. Other in-place writers on vLLM's GPU path reach the same tensors: the
rotary embedding rotates ``q``/``k`` in place, and the sampler scales logits in
place (nnsight already copies the logits for that one).

Fix, at one place for every caller (trace, invoke, registered block, cache,
every pipeline stage, ``n > 1``): when a block or a ``tracer.cache()`` was
served a module's input or output, the model continues with a *copy* of the
value, taken after every block parked there has run (so their in-place edits
and swaps are in the copy). Whatever the block kept (the value, a view of it, a
tuple holding it) is then never written by the model again: it is what the
model produced at that moment, which is what transformers gives. Locations no
block reads cost one set lookup, as before (nnsight's own fast path).

What a user's own edit does is unchanged: an in-place edit or a swap made while
the block holds a location lands in the model (it is in the copy). An in-place
edit of a value kept from an *earlier* location no longer reaches the model;
under transformers it would not either (the forward has moved past it).

Cost: one device copy per served location per step (``docs/gpu.md`` has the
measured throughput with and without). ``NNSIGHT_RAY_SNAPSHOT_SAVES=0`` turns
it off for a model whose kernels are known not to write in place.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from nnsight.modeling.vllm.interleaver import _copy_into  # nnsight's write-back of a tap's edit
from nnsight.util import apply

from .classes import extend

ENV = "NNSIGHT_RAY_SNAPSHOT_SAVES"

def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _copy(value: Any) -> Any:
    return apply(value, torch.Tensor.clone, torch.Tensor)


class SnapshotInterleaver:
    """Behaviour added to nnsight's interleaver: the model keeps a copy of every served value.

    Installed by class swap (`install`), as nnsight swaps its runner class and
    ``pipeline.StageInterleaver`` is installed on top of this, so the envoy
    tree and every module controller keep pointing at the same object.
    """

    _replaying = False

    def _served(self, provider: str) -> bool:
        return bool(self.observers.get(provider)) or (provider in self.parked and bool(self._ready(provider)))

    def handle(self, provider: str, value: Any) -> Any:
        served = not self._replaying and self._served(provider)
        value = super().handle(provider, value)  # type: ignore[misc]
        return _copy(value) if served else value

    def replay(self, location: str, live: Any) -> None:
        """A tap served from a replayed CUDA graph (``VLLMInterleaver.replay``): the block gets the copy.

        The graph reads and rewrites ``live`` in place every step, so here the
        roles turn round: the blocks are handed a copy, and what they leave
        (their in-place edits, or a swap) is copied back into ``live`` for the
        graph to go on with. Two device copies per served tap per step; a tap
        nobody reads this step costs what it costs nnsight.
        """
        if not self.interleaving or not self._served(location):  # type: ignore[attr-defined]
            return super().replay(location, live)  # type: ignore[misc]
        total = self.batcher.total  # type: ignore[attr-defined]
        live = apply(live, lambda t: t[:total] if t.dim() and t.shape[0] > total else t, torch.Tensor)
        self._replaying = True
        try:
            served = self.handle(location, _copy(live))
        finally:
            self._replaying = False
        _copy_into(live, served)

    @staticmethod
    def install(interleaver: Any) -> None:
        extend(interleaver, SnapshotInterleaver)


class SnapshotRunnerMixin:
    """Runner mixin (after ``StageRunnerMixin``, before nnsight's runner): installs `SnapshotInterleaver`."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        if enabled():
            SnapshotInterleaver.install(self.nnsight_model.interleaver)  # type: ignore[attr-defined]
