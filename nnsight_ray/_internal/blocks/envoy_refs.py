"""A request's block names the rank's own envoy tree instead of carrying a copy.

Problem (nnsight 0.8.1). ``VLLM._attach_mediators`` pickles every invoke's
worker on its own, and a worker's frame holds the model envoy, so every request
carries the whole envoy tree: each envoy's state, with only the modules and the
interleaver referenced by persistent id (``Envoy.__getstate__``). For a 4-layer
model that is 53 envoys and ~1,500 objects walked per request: 2.6 ms of the
client's time and 8 KB on the wire per request, against 0.25 ms and 0.2 KB
when the tree is referenced (measured in docs/performance.md, "Where the time
goes"); the rank then rebuilds those 53 envoys for every request, too.

Design. nnsight's own seam for "the far side has this object" is the persistent
id. While ``LocalVLLM._attach_mediators`` serializes, every envoy of the client
tree is tagged ``Envoy:<path>`` (so the pickler writes the id, never the
envoy), and every rank resolves ``Envoy:<path>`` to its own envoy at that path
(``EnvoyRefsRunnerMixin``), which wraps the same module and the same
interleaver the by-value copy would. The tags exist only during the attach:
nnsight's other senders (``serve=``, NDIF's ``remote=``) pickle the tree as
before, for servers that know nothing of these ids.

By value still, where the rank's tree is not the client's: a pipeline stage
(its tree lacks the other stages' submodules) and a client built with its own
``rename=`` or ``envoys=``; and everywhere with ``NNSIGHT_RAY_ENVOY_REFS=0``
(read per trace: ``python -m benchmarks.gpu --engines ray,ray%byvalue --env byvalue=NNSIGHT_RAY_ENVOY_REFS=0``
compares them; ``python -m benchmarks.attach --envoys-by-value`` times the caller's part).
Concurrent attaches from several threads share the
tags under one lock, so a tag is never removed under another thread's pickle.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

PREFIX = "Envoy:"

_lock = threading.RLock()


def envoy_objects(model: Any) -> dict[str, Any]:
    """``{"Envoy:<path>": envoy}`` for every envoy of ``model``'s tree (the root included)."""
    return {f"{PREFIX}{envoy.path}": envoy for envoy in model.modules()}


def same_tree_as_ranks(model: Any, pipeline_stages: int) -> bool:
    """Does every rank hold an envoy tree equal to ``model``'s? (Then envoys may travel by reference.)"""
    from nnsight.modeling.vllm.envoys import parallel_envoys

    # A rank builds its tree as nnsight's runner does: `VLLM(module)`, default envoys, no aliases.
    if os.environ.get("NNSIGHT_RAY_ENVOY_REFS", "1") == "0":
        return False
    return (pipeline_stages == 1 and not model.__dict__.get("_rename")
            and model.__dict__.get("_envoys") == parallel_envoys())


@contextmanager
def by_reference(model: Any) -> Iterator[None]:
    """Within: nnsight's pickler writes ``model``'s envoys as ``Envoy:<path>`` persistent ids."""
    with _lock:
        envoys = list(model.modules())
        for envoy in envoys:
            envoy.__dict__["_persistent_id"] = f"{PREFIX}{envoy.path}"
        try:
            yield
        finally:
            for envoy in envoys:
                envoy.__dict__.pop("_persistent_id", None)


class EnvoyRefsRunnerMixin:
    """Runner mixin: the rank's persistent objects resolve ``Envoy:<path>`` to its own envoys."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self.nnsight_persistent_objects.update(envoy_objects(self.nnsight_model))  # type: ignore[attr-defined]
