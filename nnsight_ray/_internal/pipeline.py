"""Run a trace written against the whole model on an engine split into pipeline stages.

Problem (nnsight 0.8.1, vLLM 0.32): under pipeline parallelism each stage holds
only its own slice of the model. The client writes a block against the *full*
module tree, nnsight ships the same block to every rank, and every rank runs it
as a greenlet beside its own forward. On stage 0 the later layers are vLLM
``PPMissingLayer`` placeholders that are never called, so a block that reads
``model.model.layers[3].output`` waits there forever; on stage 1 the early
layers never run; the block's references to modules a stage lacks do not even
deserialize; and nnsight reports a trace's saves only from pipeline rank 0.

Design: every stage runs its own copy of every block (as nnsight already does),
and each copy is driven through the *whole* forward, in order, with values
taken from wherever they really exist:

* **Ownership.** At load the stages exchange their module trees (one
  ``all_gather_object`` over the pipeline group), so each knows the full tree
  and which stage runs each location: a module's ``.input``/``.skip``/
  ``.output`` belong to the stage that holds it; a container that spans
  stages (the root, ``model.model``) has its input on the first stage that
  runs it and its output on the last; ``model.logits`` / ``model.samples``
  belong to the last stage (`StageMap`). Modules a stage lacks get stand-in
  modules in the runner's persistent-object map, so any block deserializes.
* **Own locations** are served by nnsight's own interleaver, unchanged, except
  that each value handed to a block is also *recorded* (a clone, keyed by
  request, block, location and the block's own occurrence count of it).
* **Earlier stages' locations** are replayed at the start of the stage's step
  ("catch-up"), in the exact order the earlier stages handled them: each
  parked block is served the value *that stage served it*. The recordings and
  that order ride to the next stage inside the ``IntermediateTensors`` vLLM
  already sends between stages (one extra uint8 tensor, `KEY`), and each stage
  forwards what it received, so stage 2 sees stage 0's values too. A block on a
  later stage therefore reads an earlier stage's value — the cross-stage
  dependency ``layers[3].output[0][:] += layers[1].output[0]`` — with no extra
  round trip: the pull is the send the pipeline already makes, taken in the same
  receive as the hidden states.
* **Later stages' locations** are served *ghosts* (`Ghost`) once the stage's own
  forward is done ("drain"): tensors with no data whose every operation yields
  another ghost, so the copy keeps its control flow and goes on to its next
  step. Whatever the copy computes from a ghost is discarded; the stage that
  owns the location runs its own copy with the real value. Writing a ghost
  into a real tensor, or swapping one into the model, is a use of a later
  stage's value on an earlier stage and raises `PipelineDependencyError`;
  turning one into a Python value (``bool``, ``.item()``) stops that copy
  quietly (`GhostStop`), and a later stage that then misses a value that copy
  would have recorded reports which location, step and stage.
* **Counts.** nnsight matches a read to a visit by per-location counts. Every
  location is counted exactly once per visit on every stage (own ones as they
  fire, earlier ones in the catch-up, later ones after the drain), so a
  ``tracer.iter[...]`` step means the same visit on every stage.
* **Collection.** Every stage's first tensor-parallel rank reports its trace
  saves and errors (nnsight reports only global rank 0's); a name whose value
  holds a ghost is dropped, and an error a copy raised after it had been served
  a ghost is dropped too, since the owning stage ran the same code on real
  values. ``merge_collected`` then unions the stages.

Everything here is installed by the runner classes (`StageRunnerMixin`,
`StageForwardMixin`) only when ``pipeline_parallel_size > 1``; at ``pp=1`` the
runner pays one attribute test per step.
"""

from __future__ import annotations

import io
import logging
import math
import pickle
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
from greenlet import getcurrent
from nnsight.intervention.interleaver import EarlyStopException, Event, Mediator
from nnsight.util import apply

from ..errors import NNsightRayError

if TYPE_CHECKING:
    from nnsight.modeling.vllm.model_runners.GPUModelRunner import Request

logger = logging.getLogger(__name__)

__all__ = [
    "KEY",
    "Ghost",
    "GhostStop",
    "PipelineDependencyError",
    "StageMap",
    "StageMediator",
    "StageInterleaver",
    "StageRunnerMixin",
    "StageForwardMixin",
    "build_stage_map",
    "contains_ghost",
]

#: The ``IntermediateTensors`` keys the recordings travel under between stages.
KEY = "nnsight_pp"
KEY_DATA = "nnsight_pp.data"

#: A location's owner when no single stage runs it (handled by every stage).
LOCAL = -1


class PipelineDependencyError(NNsightRayError):
    """A block uses a value in a way pipeline stages cannot provide (per request; recoverable)."""


class GhostStop(EarlyStopException):
    """A stage's copy of a block branched on a later stage's value; that copy ends quietly."""


# ---------------------------------------------------------------------------
# Ghosts: placeholders for values a later stage computes
# ---------------------------------------------------------------------------

_EMPTY = torch.empty(0)

# Tensor attributes answered from the placeholder's own (real, empty) tensor:
# metadata a block may pass on (``device=x.device``) without it being a value.
_PASSTHROUGH = frozenset(
    {
        "dtype", "device", "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse",
        "is_quantized", "is_mkldnn", "is_nested", "requires_grad", "is_leaf",
        "grad_fn", "names", "_version", "__class__", "__dict__",
    }
)
# Conversions to Python values: a block branching on a ghost cannot continue.
_CONCRETE = frozenset(
    {
        "__bool__", "__int__", "__float__", "__complex__", "__index__", "__len__",
        "item", "tolist", "numpy", "__array__", "__contains__",
    }
)
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__", "__set__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
        "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
        "__ilshift__", "__irshift__", "__imatmul__",
    }
)


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return f"{name}:{getattr(owner, '__name__', '')}"
    return name


def _first_ghost(args: Any, kwargs: Any) -> Optional["Ghost"]:
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten((args, kwargs or {}))
    for leaf in leaves:
        if isinstance(leaf, Ghost):
            return leaf
    return None


def _current_location() -> str:
    """The location the running block was last served on this stage, for messages."""
    ref = getattr(getcurrent(), "mediator", None)
    mediator = ref() if ref is not None else None
    return getattr(mediator, "_pp_last", None) or "a location of this stage"


class Ghost(torch.Tensor):
    """A stand-in for a value a later pipeline stage computes.

    Holds no data. Every torch operation on it returns another ghost carrying
    the same origin, so indexing, arithmetic, ``.clone()`` and ``.save()`` all
    work and the block keeps its control flow. Three things cannot work and
    say so: an in-place write of a ghost into a real tensor
    (`PipelineDependencyError`), and a conversion to a Python value —
    ``bool()``, ``.item()``, ``len()``, iteration — which raises `GhostStop`.

    Attributes:
        origin: The location whose value this stands for.
        owner: The pipeline stage that computes it.
        here: The stage this placeholder was served on.
    """

    origin: str
    owner: int
    here: int

    @staticmethod
    def make(origin: str, owner: int, here: int) -> "Ghost":
        ghost = torch.Tensor._make_subclass(Ghost, _EMPTY)
        ghost.origin, ghost.owner, ghost.here = origin, owner, here
        return ghost

    def _stop(self, what: str) -> GhostStop:
        return GhostStop(
            f"{what} of {self.origin}, which pipeline stage {self.owner} computes: stage "
            f"{self.here}'s copy of this block stops here, stage {self.owner} runs it with the real value"
        )

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"Ghost({self.origin}, stage {self.owner})"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __hash__(self) -> int:
        return id(self)

    def __iter__(self) -> Any:
        if getattr(getcurrent(), "mediator", None) is None:
            return iter(())
        raise self._stop("iteration over the value")

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (Ghost.make, (self.origin, self.owner, self.here))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _func_name(func)
        ghost = _first_ghost(args, kwargs)
        if ghost is None or getattr(getcurrent(), "mediator", None) is None:
            # Outside a block (the runtime pickling or inspecting a value), a
            # ghost is the empty tensor it is built on.
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name.startswith("__get__:"):
            if name[len("__get__:"):] in _PASSTHROUGH:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            return Ghost.make(ghost.origin, ghost.owner, ghost.here)
        if name in ("__repr__", "__str__", "__format__"):
            return repr(ghost)
        if name in _CONCRETE:
            raise ghost._stop(f"{name.strip('_')}()")
        inplace = "out" in kwargs or name.startswith("__set__:") or name in _INPLACE_DUNDERS or (
            name.endswith("_") and not name.startswith("_")
        )
        if inplace:
            target = kwargs["out"] if "out" in kwargs else (args[0] if args else None)
            real = [t for t in _tensors(target) if not isinstance(t, Ghost)]
            if real:
                raise PipelineDependencyError(
                    f"edit of {_current_location()} on pipeline stage {ghost.here} depends on "
                    f"{ghost.origin}, which pipeline stage {ghost.owner} computes later in the forward "
                    "(a value read in an earlier step, or out of forward order): not supported under "
                    "pipeline parallelism. Use values from earlier in the forward, or run with "
                    "pipeline_parallel_size=1."
                )
            return target
        return Ghost.make(ghost.origin, ghost.owner, ghost.here)


def _tensors(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def contains_ghost(value: Any, _depth: int = 0) -> Optional[Ghost]:
    """The first `Ghost` inside ``value`` (containers and one level of objects), or None."""
    if isinstance(value, Ghost):
        return value
    if isinstance(value, torch.Tensor) or _depth > 6:
        return None
    if isinstance(value, dict):
        items: Iterable = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif _depth < 2 and hasattr(value, "__dict__") and not isinstance(value, type):
        items = list(vars(value).values())
    else:
        return None
    for item in items:
        found = contains_ghost(item, _depth + 1)
        if found is not None:
            return found
    return None


class _Slot:
    """Marks where a tensor sat in a recorded value's structure (see `StageState.ghost_for`)."""


_SLOT = _Slot()


# ---------------------------------------------------------------------------
# Ownership: which stage runs which location
# ---------------------------------------------------------------------------

_INDEXED = re.compile(r"^(?P<parent>.+)\.(?P<index>\d+)(?P<rest>(\..*)?)$")


@dataclass
class StageMap:
    """Which pipeline stage owns each location, as seen from one stage.

    Attributes:
        stage: This stage's index.
        num_stages: Pipeline size.
        owner: Provider -> owning stage, for every module location of the full
            tree plus ``{root}.logits`` / ``{root}.samples``.
        modules: Module path -> (input owner, output owner): different for a
            container whose children span stages, ``LOCAL`` for a path no
            stage really holds.
        later: Providers a later stage owns (counted once per step after the drain).
        names: Every provider, sorted: ``names[i]`` is code ``i`` on the wire.
        templates: Later provider -> this stage's sibling whose value has the
            same structure (layer ``i`` of a split list -> an own layer).
        missing: Module paths of the full tree this stage does not hold.
    """

    stage: int
    num_stages: int
    owner: dict[str, int]
    modules: dict[str, tuple[int, int]]
    later: tuple[str, ...]
    names: list[str]
    templates: dict[str, str]
    missing: list[str]
    codes: dict[str, int] = field(default_factory=dict)
    template_sources: frozenset = frozenset()
    _resolved: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.codes = {name: i for i, name in enumerate(self.names)}
        self.template_sources = frozenset(self.templates.values())

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def owner_of(self, provider: str) -> int:
        """The stage that runs ``provider``, or `LOCAL` if each stage handles it itself.

        Locations outside the module map (``.source`` operations, ``result``)
        belong to the nearest enclosing module's body: its owner, or `LOCAL`
        inside a container that spans stages.
        """
        found = self.owner.get(provider)
        if found is not None:
            return found
        found = self._resolved.get(provider)
        if found is not None:
            return found
        found = LOCAL
        path = provider
        while "." in path:
            path = path.rsplit(".", 1)[0]
            span = self.modules.get(path)
            if span is not None:
                found = span[0] if span[0] == span[1] else LOCAL
                break
        self._resolved[provider] = found
        return found

    def code(self, provider: str) -> int | str:
        return self.codes.get(provider, provider)

    def name(self, code: int | str) -> str:
        return self.names[code] if isinstance(code, int) else code


def build_stage_map(stage: int, trees: list[dict[str, bool]], root: str = "model") -> StageMap:
    """Work out location ownership from every stage's module tree.

    ``trees[s]`` maps each module path stage ``s`` has to whether it is real
    there (``False`` for a ``PPMissingLayer`` placeholder). A module's home is
    the first stage where it is real; a module whose descendants live on
    several stages spans them: its ``.input``/``.skip`` belong to the first of
    those and its ``.output`` to the last. Pure, so it is unit-tested without
    an engine.
    """
    num_stages = len(trees)
    paths = sorted({path for tree in trees for path in tree})
    # Each module's home, handed up to every enclosing module (one pass).
    homes_of: dict[str, set] = {path: set() for path in paths}
    for path in paths:
        home = next((s for s, tree in enumerate(trees) if tree.get(path)), None)
        if home is None:
            continue
        ancestor = path
        while True:
            if ancestor in homes_of:
                homes_of[ancestor].add(home)
            if "." not in ancestor:
                break
            ancestor = ancestor.rsplit(".", 1)[0]

    modules: dict[str, tuple[int, int]] = {}
    for path in paths:
        homes = homes_of[path]
        if not homes:
            modules[path] = (LOCAL, LOCAL)
        elif len(homes) == 1:
            home = homes.pop()
            modules[path] = (home, home)
        else:
            modules[path] = (min(homes), max(homes))

    owner: dict[str, int] = {}
    for path, (first, last) in modules.items():
        owner[f"{path}.input"] = first
        owner[f"{path}.skip"] = first
        owner[f"{path}.output"] = last
    owner[f"{root}.logits"] = num_stages - 1
    owner[f"{root}.samples"] = num_stages - 1

    later = tuple(sorted(p for p, s in owner.items() if s > stage))

    # A later stage's layer has the structure of one this stage holds, when
    # both are entries of the same split list.
    templates: dict[str, str] = {}
    own_index: dict[str, int] = {}
    for path, (first, last) in modules.items():
        match = _INDEXED.match(path)
        if match and not match.group("rest") and first == last == stage:
            parent = match.group("parent")
            own_index[parent] = max(own_index.get(parent, -1), int(match.group("index")))
    for provider in later:
        loc, _, kind = provider.rpartition(".")
        match = _INDEXED.match(loc)
        if match and match.group("parent") in own_index:
            sibling = f"{match.group('parent')}.{own_index[match.group('parent')]}{match.group('rest')}.{kind}"
            if sibling in owner and owner[sibling] == stage:
                templates[provider] = sibling

    mine = trees[stage]
    missing = [path for path in paths if not mine.get(path)]
    return StageMap(
        stage=stage,
        num_stages=num_stages,
        owner=owner,
        modules=modules,
        later=later,
        names=sorted(owner),
        templates=templates,
        missing=missing,
    )


def module_tree(model: Any) -> dict[str, bool]:
    """This stage's module paths and whether each is real (not a vLLM ``PPMissingLayer``)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return {envoy.path: not isinstance(envoy._module, PPMissingLayer) for envoy in model.modules()}


class StageStub(torch.nn.Module):
    """Stands in for a module another pipeline stage holds, so blocks that name it deserialize here."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.nnsight_pp_path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.nnsight_pp_path} runs on another pipeline stage, not this one")

    def extra_repr(self) -> str:
        return self.nnsight_pp_path


class StagePersistentObjects(dict):
    """The runner's persistent-object map, answering for modules other stages hold.

    nnsight's unpickler asks ``pid in objects`` and then ``objects[pid]``; a
    ``Module:<path>`` this stage lacks resolves to a `StageStub`, built once.
    """

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or (isinstance(key, str) and key.startswith("Module:"))

    def __missing__(self, key: str) -> Any:
        if not (isinstance(key, str) and key.startswith("Module:")):
            raise KeyError(key)
        stub = self[key] = StageStub(key[len("Module:"):])
        return stub


# ---------------------------------------------------------------------------
# The recordings that travel between stages
# ---------------------------------------------------------------------------

@dataclass
class StageMessage:
    """What stages ``0..k`` hand stage ``k+1`` for one step.

    Attributes:
        order: Every location stages ``0..k`` handled this step, in order (codes).
        values: ``(mediator key, provider code, occurrence)`` -> the values
            served to that block there, in the order it read them.
        stopped: Mediator key -> why that block's copy on an earlier stage ended.
    """

    order: list = field(default_factory=list)
    values: dict = field(default_factory=dict)
    stopped: dict = field(default_factory=dict)


class _Unsendable:
    """A recorded value that could not be pickled; serving it raises."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Written:
    """Recorded where the owning stage applied a block's swap or skip (no value travels)."""

    def __reduce__(self) -> Any:
        return (_written, ())


def _written() -> "_Written":
    return WRITTEN


WRITTEN = _Written()


_ALIGN = 16


class _Packer(pickle.Pickler):
    """Pickles a message with its tensors moved out into one flat byte buffer.

    Pickling a tensor the ordinary way costs a few hundred microseconds each
    (storage reduction); a decode step's recordings are a handful of one-row
    tensors, so that cost would dominate. Each tensor is instead written as raw
    bytes at an aligned offset of one ``uint8`` buffer on the tensors' own
    device, and the pickle carries only ``(offset, dtype, shape)``.
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=5)
        self.chunks: list[torch.Tensor] = []
        self.size = 0
        self.device: Any = None

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or isinstance(obj, Ghost):
            return None
        flat = obj.detach().contiguous().reshape(-1).view(torch.uint8)
        if self.device is None:
            self.device = flat.device
        flat = flat.to(self.device)
        offset = self.size
        self.chunks.append(flat)
        pad = (-flat.numel()) % _ALIGN
        if pad:
            self.chunks.append(torch.zeros(pad, dtype=torch.uint8, device=flat.device))
        self.size += flat.numel() + pad
        return ("t", offset, obj.dtype, tuple(obj.shape))


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: Any, data: Optional[torch.Tensor]) -> None:
        super().__init__(file)
        self.data = data

    def persistent_load(self, pid: Any) -> Any:
        _, offset, dtype, shape = pid
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + nbytes].view(dtype).view(shape)


def _pad_bytes(body: bytes, tp_size: int) -> torch.Tensor:
    """``body`` with its length in front, padded so the length is not a multiple of ``tp_size``.

    vLLM splits a tensor whose size divides the tensor-parallel size across
    those ranks and all-gathers it on arrival, which would splice the pieces of
    every rank's own copy.
    """
    size = 8 + len(body)
    pad = (1 - size) % tp_size if tp_size > 1 else 0
    return torch.frombuffer(bytearray(len(body).to_bytes(8, "little")) + body + bytes(pad), dtype=torch.uint8)


def encode_message(message: StageMessage, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """``message`` as the intermediate tensors vLLM sends between stages.

    ``KEY`` holds the pickled structure (a CPU ``uint8`` tensor, which vLLM
    sends over its CPU group) and ``KEY + ".data"`` the recorded tensors' bytes,
    on their own device. A recorded value that does not pickle travels as a
    marker that fails the block that needs it, not the engine.
    """
    state = {"order": message.order, "values": message.values, "stopped": message.stopped}
    buffer = io.BytesIO()
    packer = _Packer(buffer)
    try:
        packer.dump(state)
    except Exception:
        values = {key: list(entries) for key, entries in message.values.items()}
        for entries in values.values():
            for i, value in enumerate(entries):
                try:
                    _Packer(io.BytesIO()).dump(value)
                except Exception as exc:
                    entries[i] = _Unsendable(f"{type(exc).__name__}: {exc}")
        state["values"] = values
        buffer = io.BytesIO()
        packer = _Packer(buffer)
        packer.dump(state)
    packed = {KEY: _pad_bytes(buffer.getvalue(), tp_size)}
    if packer.chunks:
        data = torch.cat(packer.chunks)
        if tp_size > 1 and data.numel() % tp_size == 0:
            data = torch.cat([data, data.new_zeros(1)])
        packed[KEY_DATA] = data
    return packed


def decode_message(meta: torch.Tensor, data: Optional[torch.Tensor] = None) -> StageMessage:
    """The message `encode_message` packed; recorded tensors are views of ``data``."""
    raw = meta.detach().to("cpu").numpy().tobytes()
    size = int.from_bytes(raw[:8], "little")
    if data is not None and data.is_cpu:
        data = data.clone()  # a CPU receive may hand back a view of a reused shared-memory buffer
    state = _Unpacker(io.BytesIO(raw[8 : 8 + size]), data).load()
    return StageMessage(order=state["order"], values=state["values"], stopped=state["stopped"])


# ---------------------------------------------------------------------------
# Serving blocks
# ---------------------------------------------------------------------------


def _throw(mediator: Mediator, error: BaseException) -> Any:
    """Raise ``error`` inside the block at its current park; return where it parks next."""
    worker = mediator.worker
    worker.parent = getcurrent()
    try:
        return worker.throw(error)
    except BaseException as exception:
        if not hasattr(exception, "__intervention_tb__"):
            exception.__intervention_tb__ = exception.__traceback__
        raise


def _clone(value: Any) -> Any:
    return apply(value, lambda t: t.detach().clone(), torch.Tensor)


class StageMediator(Mediator):
    """A block on a pipeline stage: records what it reads, refuses swaps of ghosts.

    Installed on every block the runner carries (a class swap, as nnsight
    swaps its runner class) once it is known which request and registration it
    belongs to (``_pp_key``). `handle` is nnsight's own loop plus two things:
    each value served is recorded for the next stage, and a swap or skip whose
    replacement holds a `Ghost` is refused inside the block.
    """

    _pp_key: tuple = ("", "")
    _pp_last: Optional[str] = None
    _pp_ghosted: bool = False
    _pp_noted: bool = False

    def handle(self, provider: str, value: Any) -> Any:
        stage: Optional[StageState] = getattr(self.interleaver, "nnsight_stage", None)
        if stage is None or stage.map.is_last:
            return super().handle(provider, value)
        pending = self.pending
        if pending is None or pending.provider != provider:
            return value
        iteration = self.occurrence(provider)
        batcher = self.interleaver.batcher
        while pending is not None and pending.provider == provider and pending.iteration == iteration:
            if self.iteration:
                self.iteration = None
            if pending.event is Event.VALUE:
                served = value if batcher is None else batcher.narrow(value, self.batch_group)
                stage.record(self, provider, iteration, served)
                self._pp_last = provider
                self.pending = self.switch(served)
            else:
                ghost = contains_ghost(pending.value)
                if ghost is not None:
                    self.pending = _throw(
                        self,
                        PipelineDependencyError(
                            f"the value written to {provider} on pipeline stage {stage.map.stage} depends "
                            f"on {ghost.origin}, which pipeline stage {ghost.owner} computes later in the "
                            "forward: not supported under pipeline parallelism."
                        ),
                    )
                elif pending.event is Event.SWAP:
                    value = pending.value if batcher is None else batcher.widen(value, self.batch_group, pending.value)
                    stage.record(self, provider, iteration, WRITTEN)
                    self.pending = self.switch()
                else:
                    value = pending.value if batcher is None else batcher.gather_skip(value, self.batch_group, pending.value)
                    stage.record(self, provider, iteration, WRITTEN)
                    self.pending = self.switch()
            pending = self.pending
        return value


@dataclass
class StageState:
    """One stage's pipeline bookkeeping: its map, this step's recordings and what it received."""

    map: StageMap
    tp_size: int = 1
    #: The previous stage's message for this step, until the catch-up consumes it.
    inbox: Optional[StageMessage] = None
    caught_up: bool = True
    #: This step's outgoing order and recordings (non-last stages only).
    order: list = field(default_factory=list)
    values: dict = field(default_factory=dict)
    busy: bool = False
    #: The last order earlier stages sent: locations are the same every step,
    #: so a step whose earlier stages had no live block to report replays it.
    last_order: Optional[list] = None
    #: Mediator key -> why its copy on this or an earlier stage ended, kept
    #: until its request is collected (see `StageInterleaver._missing`).
    ended: dict = field(default_factory=dict)
    #: Structure of own values that later locations copy (see `StageMap.templates`).
    shapes: dict = field(default_factory=dict)

    def begin(self, message: Optional[StageMessage]) -> None:
        """Start a step, with what the previous stage sent (None on the first stage)."""
        self.inbox = message
        self.caught_up = self.map.stage == 0
        self.order = []
        self.values = {}
        self.busy = False
        if message is not None:
            self.ended.update(message.stopped)
            self.last_order = message.order

    def forget(self, request_id: str) -> None:
        """Drop what is kept about a collected request's blocks."""
        for key in [key for key in self.ended if key[0] == request_id]:
            del self.ended[key]

    def record(self, mediator: Mediator, provider: str, occurrence: int, served: Any) -> None:
        """Note one event a block had served at an own location: the value it read, or `WRITTEN`."""
        key = (getattr(mediator, "_pp_key", ("", "")), self.map.code(provider), occurrence)
        self.values.setdefault(key, []).append(served if served is WRITTEN else _clone(served))

    def ghost_for(self, provider: str, owner: int) -> Any:
        shape = self.shapes.get(self.map.templates.get(provider, ""))
        here = self.map.stage
        if shape is None:
            return Ghost.make(provider, owner, here)
        return apply(shape, lambda _: Ghost.make(provider, owner, here), _Slot)

    def outgoing(self) -> StageMessage:
        inbox = self.inbox or StageMessage()
        values = dict(inbox.values)
        values.update(self.values)
        return StageMessage(order=list(inbox.order) + self.order, values=values, stopped=dict(self.ended))


def _defer(mediator: Mediator, exception: BaseException) -> None:
    """Record a block's exception the way nnsight's deferring interleaver does."""
    mediator.exception = exception
    mediator.pending = None


def _describe(exception: BaseException) -> str:
    return f"{type(exception).__name__}: {exception}"


class StageInterleaver:
    """Behaviour added to nnsight's ``VLLMInterleaver`` on a pipeline stage.

    Installed by class swap (`install`) so the envoy tree and every module
    controller keep pointing at the same interleaver object. `handle` serves
    this stage's own locations through nnsight's handoff and lets the other
    stages' locations that also fire here (a spanning container's handoffs)
    pass through untouched; `catch_up` and `drain` serve the other stages'
    locations at their place in the forward.
    """

    nnsight_stage: StageState

    @staticmethod
    def install(interleaver: Any, state: StageState) -> None:
        base = type(interleaver)
        cls = _STAGE_CLASSES.get(base)
        if cls is None:
            cls = _STAGE_CLASSES[base] = type(f"Stage{base.__name__}", (StageInterleaver, base), {})
        interleaver.__class__ = cls
        interleaver.nnsight_stage = state

    def handle(self, provider: str, value: Any) -> Any:
        stage = self.nnsight_stage
        if not stage.caught_up:
            self.catch_up()
        owner = stage.map.owner_of(provider)
        if owner == stage.map.stage or owner == LOCAL:
            if owner != LOCAL and not stage.map.is_last and _counted(self.taps, provider):
                stage.busy = True
                stage.order.append(stage.map.code(provider))
                if provider in stage.map.template_sources and provider not in stage.shapes:
                    stage.shapes[provider] = apply(value, lambda _: _SLOT, torch.Tensor)
            return super().handle(provider, value)  # type: ignore[misc]
        return value

    # -- earlier stages ------------------------------------------------------

    def catch_up(self) -> None:
        """Replay every location earlier stages handled this step, in their order."""
        stage = self.nnsight_stage
        stage.caught_up = True
        if not self.mediators:
            return
        stage.busy = True
        message = stage.inbox
        if message is None:
            # The earlier stages had no live block this step (their copies
            # ended): nothing was recorded, but the locations still passed.
            if stage.last_order is None:
                for mediator in list(self.mediators):
                    pending = mediator.pending
                    if pending is not None and pending.provider is not None:
                        owner = stage.map.owner_of(pending.provider)
                        if 0 <= owner < stage.map.stage:
                            occurrence = mediator.occurrence(pending.provider)
                            try:
                                read = pending.event is Event.VALUE
                                mediator.pending = _throw(mediator, self._missing(mediator, pending.provider, occurrence, None, read))
                            except Exception as exception:
                                _defer(mediator, exception)
                self._reindex_parked()
                return
            message = stage.inbox = StageMessage(order=stage.last_order)
        for code in message.order:
            provider = stage.map.name(code)
            if provider in self.parked:
                served = False
                while ready := self._ready(provider):
                    served = True
                    for mediator in ready:
                        self._serve_recorded(mediator, provider, message)
                if served:
                    self._reindex_parked()
            self.counts[provider] = self.counts.get(provider, 0) + 1

    def _serve_recorded(self, mediator: Mediator, provider: str, message: StageMessage) -> None:
        stage = self.nnsight_stage
        occurrence = mediator.occurrence(provider)
        key = (getattr(mediator, "_pp_key", ("", "")), stage.map.code(provider), occurrence)
        values = message.values.get(key, ())
        taken = 0
        pending = mediator.pending
        try:
            while pending is not None and pending.provider == provider and pending.iteration == occurrence:
                if mediator.iteration:
                    mediator.iteration = None
                entry = values[taken] if taken < len(values) else None
                read = pending.event is Event.VALUE
                if entry is None or isinstance(entry, _Unsendable) or (entry is WRITTEN) == read:
                    mediator.pending = _throw(mediator, self._missing(mediator, provider, occurrence, entry, read))
                elif read:
                    taken += 1
                    mediator._pp_last = provider
                    mediator.pending = mediator.switch(entry)
                else:  # the owning stage applied the write; nothing to do here
                    taken += 1
                    mediator.pending = mediator.switch()
                pending = mediator.pending
        except Exception as exception:
            _defer(mediator, exception)

    def _missing(self, mediator: Mediator, provider: str, occurrence: int, entry: Any, read: bool) -> BaseException:
        """The error for a block whose copy on the owning stage did not do what this copy does."""
        stage = self.nnsight_stage
        owner = stage.map.owner_of(provider)
        what = f"the value of {provider} that pipeline stage {owner} served" if read else f"the write to {provider} that pipeline stage {owner} applied for"
        if isinstance(entry, _Unsendable):
            why = f"it could not be sent between stages ({entry.reason})"
        else:
            stopped = stage.ended.get(getattr(mediator, "_pp_key", None))
            why = (
                f"that stage's copy of this block had already ended ({stopped})"
                if stopped
                else "that stage's copy of this block took another path there"
            )
        return PipelineDependencyError(
            f"pipeline stage {stage.map.stage} needs {what} this block at step {occurrence}, but {why}. "
            "A block whose control flow depends on a value computed later in the forward cannot run under "
            "pipeline parallelism."
        )

    # -- later stages ----------------------------------------------------------

    def drain(self) -> None:
        """Serve ghosts for the later stages' locations of this step, then count them."""
        stage = self.nnsight_stage
        if not self.mediators:
            return
        stage.busy = True
        progressed = True
        while progressed:
            progressed = False
            for mediator in list(self.mediators):
                pending = mediator.pending
                if pending is None or pending.provider is None:
                    continue
                provider = pending.provider
                owner = stage.map.owner_of(provider)
                if owner <= stage.map.stage or pending.iteration != mediator.occurrence(provider):
                    continue
                progressed = True
                self._serve_ghost(mediator, provider, owner)
        counts = self.counts
        for provider in stage.map.later:
            counts[provider] = counts.get(provider, 0) + 1
        self._reindex_parked()

    def _serve_ghost(self, mediator: Mediator, provider: str, owner: int) -> None:
        occurrence = mediator.occurrence(provider)
        pending = mediator.pending
        try:
            while pending is not None and pending.provider == provider and pending.iteration == occurrence:
                if mediator.iteration:
                    mediator.iteration = None
                if pending.event is Event.VALUE:
                    mediator._pp_ghosted = True
                    mediator.pending = mediator.switch(self.nnsight_stage.ghost_for(provider, owner))
                else:  # the owning stage applies it
                    mediator.pending = mediator.switch()
                pending = mediator.pending
        except Exception as exception:
            _defer(mediator, exception)

    def settle(self) -> None:
        """Note every block that ended this step; drop errors a ghost may have caused.

        The reason travels to the next stages (see `StageInterleaver._missing`).
        A copy that had been served a ghost ran on placeholders, so its error is
        not this stage's to report: the owning stage ran the same code on real
        values and reports whatever really happens. A `PipelineDependencyError`
        is kept: it is the construct itself that cannot run.
        """
        stage = self.nnsight_stage
        for mediator in self.mediators:
            exception = mediator.exception
            if exception is None or getattr(mediator, "_pp_noted", False):
                continue
            mediator._pp_noted = True
            stage.ended[getattr(mediator, "_pp_key", ("", ""))] = f"on stage {stage.map.stage}: {_describe(exception)}"
            if getattr(mediator, "_pp_ghosted", False) and not isinstance(exception, PipelineDependencyError):
                mediator.exception = None


_STAGE_CLASSES: dict[type, type] = {}
_MODULE_LOCATIONS = ("input", "output", "skip")


def _counted(taps: frozenset, provider: str) -> bool:
    """Whether nnsight counts a visit to ``provider``: on a CUDA-graph engine only taps are."""
    return not taps or provider in taps or provider.rsplit(".", 1)[-1] not in _MODULE_LOCATIONS


# ---------------------------------------------------------------------------
# Runner integration
# ---------------------------------------------------------------------------


def _exchange_trees(tree: dict[str, bool]) -> list[dict[str, bool]]:
    """Every pipeline stage's module tree, in stage order (one collective at load)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    gathered: list[Any] = [None] * group.world_size
    dist.all_gather_object(gathered, tree, group=group.cpu_group)
    return gathered


def _ghost_free(saves: dict) -> dict:
    return {name: value for name, value in saves.items() if contains_ghost(value) is None}


def _reported_error(request: "Request") -> Optional[dict]:
    """A request's error as this stage should report it (see `StageInterleaver.settle`)."""
    if request.error is not None:
        return request.error
    mediator = request.mediator
    error = None if mediator is None else getattr(mediator, "nnsight_error", None)
    if error is None:
        return None
    if getattr(mediator, "_pp_ghosted", False) and error.get("type_name") != PipelineDependencyError.__name__:
        return None
    return error


class StageRunnerMixin:
    """Outer runner mixin (before ``NNsightGPUModelRunner`` in the MRO).

    Wraps nnsight's ``load_model`` (install the stage), ``_update_states``
    (adopt new blocks) and ``collect_nnsight`` (every stage reports, ghosts
    filtered). With ``pipeline_parallel_size == 1`` each is nnsight's own.
    """

    nnsight_stage: Optional[StageState] = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        pp = get_pp_group()
        if pp.world_size <= 1:
            return
        model = self.nnsight_model  # type: ignore[attr-defined]
        trees = _exchange_trees(module_tree(model))
        stage_map = build_stage_map(pp.rank_in_group, trees, root=model.path)
        taps = model.interleaver.taps
        stage_map.later = tuple(p for p in stage_map.later if _counted(taps, p))
        state = StageState(map=stage_map, tp_size=get_tp_group().world_size)
        StageInterleaver.install(model.interleaver, state)
        objects = StagePersistentObjects(self.nnsight_persistent_objects)  # type: ignore[attr-defined]
        for path in stage_map.missing:
            if f"Module:{path}" not in dict.keys(objects):
                objects[f"Module:{path}"] = StageStub(path)
        self.nnsight_persistent_objects = objects
        self.nnsight_stage = state
        logger.info(
            "pipeline stage %d/%d: %d locations owned here, %d on later stages, %d modules stubbed",
            stage_map.stage,
            stage_map.num_stages,
            sum(1 for s in stage_map.owner.values() if s == stage_map.stage),
            len(stage_map.later),
            len(stage_map.missing),
        )

    def _update_states(self, scheduler_output: Any) -> None:
        super()._update_states(scheduler_output)  # type: ignore[misc]
        if self.nnsight_stage is None:
            return
        requests = self.nnsight_requests.requests  # type: ignore[attr-defined]
        for request in requests.values():
            if request.mediator is not None:
                _adopt(request.mediator, (request.id, ""))
            for registration_id, copy in request.copies.items():
                _adopt(copy, (request.id, registration_id))
        ended = self.nnsight_stage.ended
        if ended:  # requests dropped without a collect (aborted) leave nothing behind
            for key in [key for key in ended if key[0] not in requests]:
                del ended[key]

    def collect_nnsight(
        self,
        request_ids: list[str],
        finished_request_ids: Optional[list[str]] = None,
        outputs: Optional[dict] = None,
    ) -> Optional[bytes]:
        if self.nnsight_stage is None:
            return super().collect_nnsight(request_ids, finished_request_ids, outputs)  # type: ignore[misc]
        from nnsight.modeling.vllm.collect import dumps_compact
        from vllm.distributed.parallel_state import get_tp_group

        requests = self.nnsight_requests  # type: ignore[attr-defined]
        finished = set(finished_request_ids or [])
        wanted = set(request_ids) | finished
        if finished:
            requests.harvest(finished)
        tracked = []
        for request in requests.requests.values():
            if not request.named(wanted):
                continue
            tracked.append((request, request.key(wanted)))
            if request.named(finished):
                self.nnsight_stage.forget(request.id)
            for taken in request.harvested.values():
                taken["saves"] = _ghost_free(taken["saves"])
            mediator = request.mediator
            saved = getattr(mediator, "nnsight_saved", None)
            if saved:
                mediator.nnsight_saved = {
                    name for name in saved if contains_ghost(mediator.lcls.get(name)) is None
                }
            pending = None if mediator is None else mediator.pending
            if (
                request.named(finished)
                and getattr(mediator, "_pp_ghosted", False)
                and mediator.alive
                and pending is not None
                and pending.provider != "result"
            ):
                # Unwound here, before nnsight's collect would report it: a copy
                # that ran on ghosts may well be parked where the real run is not.
                requests.finish_dangling(mediator, self.nnsight_model.interleaver.taps)  # type: ignore[attr-defined]
        payload = super().collect_nnsight(request_ids, finished_request_ids, outputs)  # type: ignore[misc]
        if get_tp_group().rank_in_group != 0:
            return payload
        # Every stage reports its trace's values (nnsight: global rank 0 only),
        # with any name that holds a ghost left to the stage that has it.
        # nnsight pickles the dict, except inside `payload.unserialized()`.
        serialized = isinstance(payload, bytes)
        collected = (pickle.loads(payload) if serialized else payload) or {}
        for request, (engine_id, index) in tracked:
            entry = collected.setdefault(engine_id, {"saves": {}, "error": None, "registered": {}, "sequences": {}})
            sequence = entry["sequences"].setdefault(index, {"saves": {}, "registered": {}})
            sequence["saves"] = _ghost_free(request.saves())
            if entry["error"] is None or entry["error"] is request.deferred():
                entry["error"] = _reported_error(request)
        for entry in collected.values():
            primary = entry["sequences"].get(0)
            if primary is not None:
                entry["saves"], entry["registered"] = primary["saves"], primary["registered"]
        return dumps_compact(collected) if serialized else collected


def _adopt(mediator: Mediator, key: tuple) -> None:
    if not isinstance(mediator, StageMediator):
        mediator.__class__ = StageMediator
        mediator._pp_key = key


class StageForwardMixin:
    """Inner runner mixin (after ``NNsightGPUModelRunner``): runs inside its ``with interleaver``.

    Takes the previous stage's recordings off the incoming
    ``IntermediateTensors`` before vLLM sees them, drains the later stages'
    locations once the forward is done, and puts this stage's recordings on
    the outgoing ``IntermediateTensors``.
    """

    nnsight_stage: Optional[StageState] = None

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        stage = self.nnsight_stage
        if stage is None:
            return super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        message = None
        if intermediate_tensors is not None:
            tensors = intermediate_tensors.tensors
            packed, data = tensors.pop(KEY, None), tensors.pop(KEY_DATA, None)
            if packed is not None:
                message = decode_message(packed, data)
        stage.begin(message)
        output = super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        interleaver = self.nnsight_model.interleaver  # type: ignore[attr-defined]
        if not stage.caught_up:
            interleaver.catch_up()
        if stage.map.is_last:
            return output
        interleaver.drain()
        interleaver.settle()
        if stage.busy and output is not None and hasattr(output, "tensors"):
            output.tensors.update(encode_message(stage.outgoing(), stage.tp_size))
        return output
