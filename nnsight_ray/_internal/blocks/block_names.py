"""Every block a rank receives is named by its source.

Problem (nnsight 0.8.1): a deserialized block is compiled under the name
``<edit-{id(mediator)}>`` (``Mediator.__setstate__``), and nnsight memoizes a
nested ``with`` (``tracer.all()``, ``tracer.iter[...]``, ``backward()``) by
``(filename, line, ...)`` in ``nnsight.tracing.globals.BLOCKS`` and the source
by filename in ``SOURCES``, forever. A long-lived rank reuses memory
addresses, so a new block can get an old block's name, and its nested ``with``
is then parsed from the *old* block's cached source: "nnsight found no ``with``
statement at <edit-140451252211856>:124" (1 run in 3 of nnsight's
``test_max_token_generation`` at TP=2), or worse, the old block's body.

Fix, on the rank, right after nnsight deserialized a block (the runner's
``_update_states`` for traces, ``nnsight_register`` for registered blocks):
its code (and every code object nested in it) is re-targeted to
``<nnsight-ray-block-<digest>>``, the SHA-256 of its source, with the source
registered in ``linecache`` under that name. Two blocks share a name only if
they share their source, so nnsight's memo is right for both; and the many
invokes of one trace (a loop of ``tracer.invoke``: one block) parse and
compile a nested ``with`` once per rank instead of once per request. Names are
counted: when the last request using one is collected (or the registration
cleared), the entries under it are removed from ``linecache`` and from
nnsight's two memo dicts, so a rank that serves millions of requests keeps
none of them. A block with no source in ``linecache`` gets a name never used
twice in the process (``<nnsight-ray-block-<pid>-<n>>``). Nothing of nnsight's
is replaced: only entries under names this module created are added or removed.

A block sent by nnsight_ray's own caller (``shared_blocks``) arrives through
``rebuild_mediator`` instead of nnsight's ``Mediator.__setstate__``: it is
compiled under its digest name once per source (a bounded cache of compiled
blocks), not once per request, and ``rename`` only counts the use: 256 invokes
of one trace are one compile per rank, where nnsight's ``__setstate__``
compiled 256 (a third of the rank's 100 ms of block deserialization per
256-invoke trace on the H200, docs/performance.md). Within one ``Requests.add``
equal blobs are unpickled once when their values are immutable
(``rebuild_mediator_from``): 68 -> 42 us per invoke of the rank's block setup
on the 2-core machine.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import hashlib
import itertools
import linecache
import os
import threading
import types
from collections import OrderedDict
from contextlib import contextmanager
from types import CodeType
from typing import Any, Iterator, Optional

from .classes import extend

_PREFIX = "<edit-"
_counter = itertools.count()
_users: dict[str, int] = {}  # name -> blocks using it now (each `rename` is one, each `forget` ends one)
_lock = threading.Lock()
# name -> (compiled block, its source lines), most recently received last; bounded.
_compiled: OrderedDict[str, tuple[CodeType, list[str]]] = OrderedDict()
COMPILED_BLOCKS = 256


@functools.lru_cache(maxsize=COMPILED_BLOCKS)
def _digest_name(source: str) -> str:
    return f"<nnsight-ray-block-{hashlib.sha256(source.encode()).hexdigest()[:32]}>"


def rebuild_mediator(state: dict[str, Any]) -> Any:
    """nnsight's ``Mediator.__setstate__`` for ``state``, with the block compiled once per source (its digest name).

    What ``shared_blocks.SharedReductionMediator`` pickles to. The use of the
    name is counted when the rank takes the block (``rename``), as for any block.
    """
    from nnsight.intervention.interleaver import Mediator

    source, glbls, lcls = state["reduced"]
    name = _digest_name(source)
    with _lock:
        hit = _compiled.pop(name, None)
    if hit is None:
        hit = (compile(source, name, "exec"), source.splitlines(keepends=True))
    with _lock:
        _compiled[name] = hit
        while len(_compiled) > COMPILED_BLOCKS:
            _compiled.popitem(last=False)
    mediator = Mediator.__new__(Mediator)
    mediator.__init__(hit[0], glbls, lcls, copy=state["copy"])
    mediator.presaved = state["presaved"]
    mediator._nnsight_ray_block = (name, hit[1], len(source))
    return mediator


def rebuild_mediator_from(blob: bytes) -> Any:
    """``rebuild_mediator`` of a state pickled once for several invokes (``shared_blocks``).

    Its envoy references resolve against the persistent objects of the ``Requests.add``
    or ``register`` unpickling this request (``NamedRequests``); outside one, none.

    Within one ``Requests.add`` the state of a blob is read once: the 256 invokes of a
    loop arrive with equal blobs, and a state whose values are all immutable (numbers,
    strings, modules, the model's envoys by reference, the trace's tracer: ``_shareable``)
    gives each invoke its own scope dicts, presaved set and tracer (a shallow copy) over
    the same values, as nnsight gives each request of a registered block its own copy of
    the template's scope. Any other state (a list, a tensor) is read again for each
    invoke, so no two invokes share a mutable value.
    """
    from nnsight.intervention.serialization import loads

    reads = _reads.get()
    state = None if reads is None else reads.states.get(blob)
    if state is None:
        state = loads(blob, persistent_objects=_persistent_objects.get())
        if reads is None:
            return rebuild_mediator(state)
        reads.states[blob] = state if _shareable(state, reads.persistent_ids()) else False
        if reads.states[blob] is False:
            return rebuild_mediator(state)
    elif state is False:  # read before, not shareable: read again
        return rebuild_mediator(loads(blob, persistent_objects=_persistent_objects.get()))
    source, glbls, lcls = state["reduced"]
    return rebuild_mediator({"reduced": (source, _fresh(glbls), _fresh(lcls)), "copy": state["copy"],
                             "presaved": set(state["presaved"])})


class _Reads:
    """One ``Requests.add``'s (or ``register``'s) unpickling: its persistent objects, the states read by blob."""

    def __init__(self, persistent_objects: Optional[dict]) -> None:
        self.objects = persistent_objects or {}
        self.states: dict[bytes, Any] = {}  # a state, or False: not shareable
        self._ids: Optional[set[int]] = None

    def persistent_ids(self) -> set[int]:
        if self._ids is None:
            self._ids = {id(o) for o in self.objects.values()}
        return self._ids


_ATOMS = (type(None), bool, int, float, complex, str, bytes, types.ModuleType)


def _shareable(state: dict[str, Any], persistent: set[int]) -> bool:
    """Whether every value of ``state``'s scopes is immutable, a persistent object (an envoy by
    reference), or a tracer whose own inputs are (``_fresh`` copies it for each invoke)."""
    from nnsight.tracing.tracer import Tracer

    def ok(value: Any) -> bool:
        if isinstance(value, _ATOMS) or id(value) in persistent:
            return True
        if type(value) in (tuple, frozenset):
            return all(ok(v) for v in value)
        if isinstance(value, Tracer):
            mine = vars(value)
            return ok(mine.get("args", ())) and all(ok(v) for v in (mine.get("kwargs") or {}).values())
        return False

    _, glbls, lcls = state["reduced"]
    return all(ok(v) for v in glbls.values()) and all(ok(v) for v in lcls.values())


def _fresh(scope: dict) -> dict:
    """An invoke's own copy of a shared scope: a new dict, and a new tracer object for a tracer."""
    from nnsight.tracing.tracer import Tracer

    return {name: copy.copy(value) if isinstance(value, Tracer) else value for name, value in scope.items()}


def _retarget(code: CodeType, filename: str) -> CodeType:
    consts = tuple(_retarget(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def rename(mediator: Any) -> Optional[str]:
    """Name a freshly deserialized block by its source; return the name (None if it had none to replace).

    Every name returned is one use: ``forget`` it once when the block is done.
    """
    block = getattr(mediator, "__dict__", {}).pop("_nnsight_ray_block", None)
    if block is not None:  # rebuilt by rebuild_mediator: compiled under its name already
        name, lines, size = block
        with _lock:
            linecache.cache.setdefault(name, (size, None, lines, name))
            _users[name] = _users.get(name, 0) + 1
        return name
    code = getattr(mediator, "code", None)
    if not isinstance(code, CodeType) or not code.co_filename.startswith(_PREFIX):
        return None
    entry = linecache.cache.pop(code.co_filename, None)
    with _lock:
        if entry is not None:
            new = _digest_name("".join(entry[2]))
            linecache.cache.setdefault(new, (entry[0], None, entry[2], new))
        else:
            new = f"<nnsight-ray-block-{os.getpid()}-{next(_counter)}>"
        _users[new] = _users.get(new, 0) + 1
    mediator.code = _retarget(code, new)
    return new


def forget(filename: Optional[str]) -> None:
    """One use of ``filename`` (a name `rename` gave) is over; the last drops every cache entry under it."""
    if not filename:
        return
    from nnsight.tracing import globals as nnsight_globals

    with _lock:
        users = _users.pop(filename, 0) - 1
        if users > 0:
            _users[filename] = users
            return
        linecache.cache.pop(filename, None)
        nnsight_globals.SOURCES.pop(filename, None)
        blocks = nnsight_globals.BLOCKS
        for key in [key for key in blocks if key[0] == filename]:
            del blocks[key]


def held(runner: Any) -> dict[str, int]:
    """Entries under this module's names still in ``linecache`` and nnsight's memo dicts, and names tracked."""
    from nnsight.tracing import globals as nnsight_globals

    ours = "<nnsight-ray-block-"
    return {
        "linecache": sum(1 for k in linecache.cache if str(k).startswith(ours)),
        "sources": sum(1 for k in nnsight_globals.SOURCES if str(k).startswith(ours)),
        "blocks": sum(1 for k in nnsight_globals.BLOCKS if str(k[0]).startswith(ours)),
        "tracked": len(getattr(getattr(runner, "nnsight_requests", None), "nr_names", {})),
    }


# The persistent objects of the unpickling under way on this thread (``NamedRequests``), for ``rebuild_mediator_from``.
_persistent_objects: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar(
    "nnsight_ray_persistent_objects", default=None)
# That unpickling's states, by blob, that its next equal blobs reuse (``rebuild_mediator_from``).
_reads: contextvars.ContextVar[Optional[_Reads]] = contextvars.ContextVar("nnsight_ray_reads", default=None)


@contextmanager
def _unpickling_with(persistent_objects: Optional[dict]) -> Iterator[None]:
    token = _persistent_objects.set(persistent_objects)
    reads = _reads.set(_Reads(persistent_objects))
    try:
        yield
    finally:
        _reads.reset(reads)
        _persistent_objects.reset(token)


class NamedRequests:
    """Behaviour added to nnsight's ``Requests`` (class swap): rename blocks as they are deserialized.

    Renaming has to happen between deserialization (``add``, ``register``) and
    the block's first run, which nnsight starts in ``scope`` within the same
    ``_update_states``: so it is done here, not after ``_update_states``.
    """

    nr_names: dict

    def add(self, new_requests: Any, persistent_objects: dict) -> None:
        with _unpickling_with(persistent_objects):
            super().add(new_requests, persistent_objects)  # type: ignore[misc]
        for data in new_requests:
            request = self.requests.get(data.req_id)  # type: ignore[attr-defined]
            if request is not None and request.mediator is not None and request.id not in self.nr_names:
                self.nr_names[request.id] = rename(request.mediator)

    def register(self, registration_id: str, *args: Any, **kwargs: Any) -> None:
        objects = kwargs.get("persistent_objects", args[1] if len(args) > 1 else None)
        with _unpickling_with(objects):
            super().register(registration_id, *args, **kwargs)  # type: ignore[misc]
        template = self.templates.get(registration_id)  # type: ignore[attr-defined]
        if template is not None:
            forget(self.nr_names.pop(("registration", registration_id), None))
            self.nr_names[("registration", registration_id)] = rename(template)

    def unregister(self, registration_id: str) -> None:
        super().unregister(registration_id)  # type: ignore[misc]
        forget(self.nr_names.pop(("registration", registration_id), None))

    def forget_retired(self) -> None:
        """Drop the names of requests nnsight no longer tracks (collected or dropped)."""
        for key in [k for k in self.nr_names if not isinstance(k, tuple) and k not in self.requests]:  # type: ignore[attr-defined]
            forget(self.nr_names.pop(key))

    @staticmethod
    def install(requests: Any) -> None:
        if extend(requests, NamedRequests):
            requests.nr_names = {}


class BlockNamesRunnerMixin:
    """Runner mixin: installs `NamedRequests`; forgets a block's name once its request is collected."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        NamedRequests.install(self.nnsight_requests)  # type: ignore[attr-defined]

    def collect_nnsight(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().collect_nnsight(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.nnsight_requests.forget_retired()  # type: ignore[attr-defined]
