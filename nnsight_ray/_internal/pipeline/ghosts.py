"""Ghosts: placeholders for the values a later pipeline stage computes, and the two errors they raise."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from greenlet import getcurrent
from nnsight.intervention.interleaver import EarlyStopException

from ...errors import NNsightRayError


class PipelineDependencyError(NNsightRayError):
    """A block uses a value in a way pipeline stages cannot provide (per request; the engine goes on)."""


class GhostStop(EarlyStopException):
    """A stage's copy of a block branched on a later stage's value; that copy ends quietly."""


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
    """The location the running block was last served on this stage, for messages.

    Asked of the stage the block runs on (``interleaver.nnsight_stage``, see
    `serving.StageState.last_location`), which keeps each block's bookkeeping.
    """
    ref = getattr(getcurrent(), "mediator", None)
    mediator = ref() if ref is not None else None
    stage = getattr(getattr(mediator, "interleaver", None), "nnsight_stage", None)
    last = None if stage is None else stage.last_location(mediator)
    return last or "a location of this stage"


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


def ghost_free(saves: dict) -> dict:
    """``saves`` without the names whose value holds a ghost (the stage that has the value reports them)."""
    return {name: value for name, value in saves.items() if contains_ghost(value) is None}


class Slot:
    """Marks where a tensor sat in a recorded value's structure (see `serving.StageState.ghost_for`)."""


SLOT = Slot()
