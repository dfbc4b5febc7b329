"""Adding behaviour to an object nnsight built, without replacing the object.

nnsight's runner holds its interleaver and request table in attributes that
its envoys and methods keep pointing at, so behaviour is added by giving the
instance a subclass of its own class (nnsight swaps its runner's class the
same way). One class per (mixin, base) pair, built once.
"""

from __future__ import annotations

from typing import Any

_CLASSES: dict[tuple[type, type], type] = {}


def extend(instance: Any, mixin: type) -> bool:
    """Make ``instance`` an instance of ``mixin`` over its own class; False if it already was."""
    base = type(instance)
    if issubclass(base, mixin):
        return False
    cls = _CLASSES.get((mixin, base))
    if cls is None:
        name = mixin.__name__.replace("Interleaver", "").replace("Requests", "")
        cls = _CLASSES[(mixin, base)] = type(f"{name}{base.__name__}", (mixin, base), {})
    instance.__class__ = cls
    return True
