"""A trace's invokes reduce their shared block once, not once per invoke.

Problem (nnsight 0.8.1). ``VLLM._attach_mediators`` pickles every invoke's
worker on its own, and ``Mediator.__getstate__`` reduces the worker's block
with ``reduce_block``: ``ast.unparse`` of the block, then ``ast.parse`` and two
``ast.walk`` passes to find the names it reads. A trace written as a loop of N
invokes has one block, reduced N times, all on the caller's thread before the
first request leaves: 1.5 ms per invoke of the caller's 5.4 ms on the 2-core
machine, a quarter of a 64-invoke trace's whole time (cProfile,
docs/performance.md, "The caller's cost per invoke").

Design. While ``LocalVLLM._attach_mediators`` serializes, each worker's class
is swapped for ``SharedReductionMediator``, whose state is nnsight's own
(``{"reduced": (source, globals, locals), "copy", "presaved"}``) built from a
per-attach cache of each distinct block's source and names: nnsight's
``reduce_block`` runs once per block (the names are the ones its ``code_reduce``
looks up), and each invoke only filters its own scope by those names, as
``code_reduce`` does. It unpickles as a plain nnsight ``Mediator`` with that
state through ``block_names.rebuild_mediator`` (nnsight's ``__setstate__``,
but the block compiled once per source on the receiving rank, not once per
invoke), so the receiver needs nnsight_ray, as every rank has; the swap is
undone when the attach ends, whether or not it succeeded.

The state is pickled once, too, for every invoke whose state holds the same
objects (``_state_key``: a loop of invokes that reads only the model, a layer
index and a flag): nnsight's ``dumps`` of it once, and each invoke's request
carries those bytes inside a two-item pickle (``block_names.rebuild_mediator_from``),
one bytes object for all of them (``one_object_per_payload``: Ray writes it once).
That two-item pickle is made once per state too: nnsight's attach calls its module's
``dumps`` per invoke, a cloudpickle pickler each, and while an attach runs
``_attach_dumps`` stands in for it (``PAYLOAD_CACHE``; attach of 256 invokes 8.5 -> 3.3
ms on the 2-core machine, alternated in one process, bytes equal: issue 53).
nnsight's pickler per invoke was most of a 256-invoke attach (cProfile: 17 of
18 ms, ~19 ``persistent_id`` calls an invoke). The rank unpickles the inner
bytes with the persistent objects nnsight's ``Requests.add`` was given (the
model's envoys by reference), which ``block_names.NamedRequests`` hands it. ``tests/unit/test_shared_blocks.py`` holds the state equal to
nnsight's for the same workers, but for one difference:

A name the block binds before it reads it is not shipped. nnsight's
``_referenced_names`` takes every name the block reads anywhere, with no
notion of order, so ``h = nnsight.save([])`` followed by ``h.append(...)`` in
a loop ships the enclosing scope's old ``h`` with every invoke: a notebook
cell run twice sent the previous run's saved tensors 64 times (30-66 s a
trace on the 2-core machine, docs/performance.md). The block can never see
that value: here a name whose first mention in the block is a plain,
unconditional top-level assignment whose right side does not mention it
(``_bound_before_read``) is left out. Anything less certain (a conditional or
nested binding, an augmented assignment, a read on the right side) still ships.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Iterable, Iterator

from nnsight.intervention.interleaver import Mediator


class SharedReductionMediator(Mediator):
    """A ``Mediator`` during an attach: its block's reduction comes from the attach's cache."""

    _nnsight_ray_reductions: dict[int, tuple[Any, str, frozenset[str]]]
    _nnsight_ray_blobs: dict[tuple, bytes]
    _nnsight_ray_payloads: dict[tuple, bytes]

    def __getstate__(self) -> dict:
        from nnsight.tracing.tracer import _saves

        source, names = _reduction(self._nnsight_ray_reductions, self.node)
        used_globals, used_locals = {}, {}
        for name in names:  # nnsight's code_reduce: locals first, then globals by subscript (a Scope's fallbacks)
            if name in self.lcls:
                used_locals[name] = self.lcls[name]
                continue
            try:
                used_globals[name] = self.glbls[name]
            except KeyError:
                pass
        # nnsight's Mediator.__getstate__ from here: saved-ness travels by name.
        presaved = {name for name, value in used_locals.items() if id(value) in _saves()}
        self.presaved = presaved
        return {"reduced": (source, used_globals, used_locals), "copy": self.copy, "presaved": presaved}

    def __reduce_ex__(self, protocol: int) -> tuple:
        """The state pickled once for every invoke of the attach that has the same one (`_state_key`)."""
        from nnsight.intervention.serialization import dumps

        from .block_names import rebuild_mediator_from

        state = self.__getstate__()
        key = _state_key(self.node, state)
        blob = self._nnsight_ray_blobs.get(key)
        if blob is None:
            # nnsight's own pickler, inside the attach's: the model's envoys still travel as references.
            blob = self._nnsight_ray_blobs[key] = dumps(state)
        return (rebuild_mediator_from, (blob,))

    def nnsight_ray_payload(self, dumps: Any) -> bytes:
        """The request's bytes, ``dumps(self)``, made once per distinct state of the attach (``_state_key``).

        They are ``(rebuild_mediator_from, (blob,))`` pickled, the same for every invoke of
        one state, so the pickler nnsight builds per invoke runs once per state instead.
        """
        key = _state_key(self.node, self.__getstate__())
        payload = self._nnsight_ray_payloads.get(key)
        if payload is None:
            payload = self._nnsight_ray_payloads[key] = dumps(self)
        return payload


def _state_key(node: Any, state: dict) -> tuple:
    """Equal for two invokes whose states pickle to the same bytes: the same block, the same objects.

    By identity, not value: every value is alive (held by its invoke's scope) for the
    whole attach, so no two of them share an id, and no user code runs between two
    invokes' pickling, so an object pickles the same for both (``presaved`` follows from
    the same identities).
    """
    _, used_globals, used_locals = state["reduced"]
    return (id(node), state["copy"],
            tuple((name, id(value)) for name, value in used_globals.items()),
            tuple((name, id(value)) for name, value in used_locals.items()))


class _AskedNames(dict):
    """An empty scope that records which names nnsight's ``code_reduce`` looks up in it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def __contains__(self, name: object) -> bool:
        self.asked.add(name)  # type: ignore[arg-type]
        return False


def _reduction(cache: dict[int, tuple[Any, str, frozenset[str]]], node: Any) -> tuple[str, frozenset[str]]:
    """The block's source and the names it reads, from nnsight's ``reduce_block``, once per block per attach."""
    from nnsight.intervention.serialization import reduce_block

    hit = cache.get(id(node))
    if hit is None:
        scope = _AskedNames()
        source = reduce_block(node, {}, scope)[0]
        names = frozenset(scope.asked) - _bound_before_read(node.body)
        hit = cache[id(node)] = (node, source, names)  # the node pins its id
    return hit[1], hit[2]


def _bound_before_read(body: list[Any]) -> frozenset[str]:
    """Names the block's top level binds with a plain assignment before any statement mentions them.

    Statements run in order, so such a name's value in the enclosing scope is
    never seen by the block. Conservative: any mention (a load, a store inside
    a compound statement, a lambda's body, the assignment's own right side)
    before the binding keeps the name.
    """
    import ast

    seen: set[str] = set()
    bound: set[str] = set()
    for statement in body:  # the block's statements, as nnsight unparses them
        targets = _plain_targets(statement.targets) if isinstance(statement, ast.Assign) else None
        if targets is not None:
            seen.update(node.id for node in ast.walk(statement.value) if isinstance(node, ast.Name))
            bound.update(targets - seen)
            seen.update(targets)
            continue
        seen.update(node.id for node in ast.walk(statement) if isinstance(node, ast.Name))
    return frozenset(bound)


def _plain_targets(targets: list[Any]) -> set[str] | None:
    """The names an assignment's targets bind, if every target is a name or a tuple/list of names; else None."""
    import ast

    names: set[str] = set()
    for target in targets:
        if isinstance(target, ast.Starred):
            target = target.value
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            inner = _plain_targets(target.elts)
            if inner is None:
                return None
            names |= inner
        else:
            return None
    return names


# ``VLLM._attach_mediators`` pickles each worker with its module's ``dumps``: while any attach runs,
# ``_attach_dumps`` stands in for it (``shared_reductions``). "0": nnsight's own, a pickler per invoke.
PAYLOAD_CACHE = os.environ.get("NNSIGHT_RAY_PAYLOAD_CACHE", "1") == "1"
_attaches = 0
_attaches_lock = threading.Lock()


def _attach_dumps(obj: Any, *args: Any, **kwargs: Any) -> bytes:
    """nnsight's ``dumps``; a shared-reduction worker's bytes come from its attach's cache."""
    from nnsight.intervention.serialization import dumps

    if type(obj) is SharedReductionMediator and not args and not kwargs:
        return obj.nnsight_ray_payload(dumps)
    return dumps(obj, *args, **kwargs)


@contextmanager
def _attach_dumps_installed() -> Iterator[None]:
    """``_attach_dumps`` in nnsight's vLLM module while at least one attach runs (in any thread)."""
    global _attaches
    from nnsight.intervention import serialization
    from nnsight.modeling.vllm import vllm as nnsight_vllm

    with _attaches_lock:
        # Only over nnsight's own (a nnsight whose attach pickles otherwise keeps its way).
        installed = _attaches > 0 or nnsight_vllm.dumps is serialization.dumps
        if installed:
            _attaches += 1
            nnsight_vllm.dumps = _attach_dumps
    try:
        yield
    finally:
        if installed:
            with _attaches_lock:
                _attaches -= 1
                if _attaches == 0:
                    nnsight_vllm.dumps = serialization.dumps


@contextmanager
def shared_reductions(mediators: Iterable[Any]) -> Iterator[None]:
    """Within: ``mediators`` (nnsight workers with a block) pickle with one reduction per distinct block."""
    cache: dict[int, tuple[Any, str, frozenset[str]]] = {}
    blobs: dict[tuple, bytes] = {}
    payloads: dict[tuple, bytes] = {}
    swapped = [m for m in mediators if type(m) is Mediator and m.node is not None]
    for mediator in swapped:
        mediator.__class__ = SharedReductionMediator
        mediator._nnsight_ray_reductions = cache
        mediator._nnsight_ray_blobs = blobs
        mediator._nnsight_ray_payloads = payloads
    try:
        with _attach_dumps_installed() if PAYLOAD_CACHE and swapped else nullcontext():
            yield
    finally:
        for mediator in swapped:
            mediator.__class__ = Mediator
            for name in ("_nnsight_ray_reductions", "_nnsight_ray_blobs", "_nnsight_ray_payloads"):
                mediator.__dict__.pop(name, None)


def one_object_per_payload(params: list) -> None:
    """Make the requests' equal ``nnsight_mediator`` bytes one object (after nnsight's attach).

    The invokes of a loop carry equal bytes (one state, pickled once: ``_state_key``), but
    each its own copy of them, so pickling the requests for the engine actor (Ray) wrote
    every copy: 396 kB for 256 invokes of one saved value, where one copy is 1.5 kB. One
    object is written once (pickle's memo); the engine actor gets equal bytes as before.
    """
    seen: dict[bytes, bytes] = {}
    for param in params:
        extra = param.extra_args
        blob = extra.get("nnsight_mediator") if isinstance(extra, dict) else None
        if isinstance(blob, bytes):
            extra["nnsight_mediator"] = seen.setdefault(blob, blob)

