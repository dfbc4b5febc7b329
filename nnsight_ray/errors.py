"""Every error nnsight_ray raises on purpose, and whether it is recoverable.

Also the typed form of an intervention's error (`intervention_error`): the
merge actors raise it, the caller catches it as the builtin type it was.
"""

from __future__ import annotations

import builtins
import re
from typing import Any


class NNsightRayError(RuntimeError):
    """Base class. ``recoverable``: may the same engine serve the next request?"""

    recoverable = True


class PlacementError(NNsightRayError):
    """The cluster cannot host the requested ranks; nothing was started."""

    recoverable = False


class EngineDeadError(NNsightRayError):
    """A rank or the engine died; every pending request fails; rebuild the engine."""

    recoverable = False


class RequestError(NNsightRayError):
    """One request was refused or failed; the engine and other requests go on."""


# One class per builtin exception type, so `except ValueError` and identity
# checks see the same class every time.
_TYPED_ERRORS: dict[str, type[RequestError]] = {}


def _str(self: BaseException) -> str:
    # KeyError's own __str__ would repr() the multi-line message.
    return str(self.args[0]) if self.args else ""


class BlockTimeoutError(RequestError, TimeoutError):
    """A request's intervention block ran past its deadline and was stopped on the rank.

    Only that request failed; the engine and every other request went on. A
    ``TimeoutError`` too, so ``except TimeoutError`` catches it. The message
    names the request, where the block was, how long it ran and the limit
    (``block_timeout_s`` / ``block_total_timeout_s``) with how to raise it.
    """

    __str__ = _str


_TYPED_ERRORS[BlockTimeoutError.__name__] = BlockTimeoutError
# The part of a BlockTimeoutError's message that says how long the block held the model's thread.
_HELD = "its intervention block was stopped after running {:.1f} s"
_HELD_PATTERN = re.compile(re.escape(_HELD).replace(re.escape("{:.1f}"), r"([0-9]+(?:\.[0-9]+)?)"))


def block_held(seconds: float) -> str:
    """The words of a BlockTimeoutError's message that carry how long the block ran (``held_seconds`` reads them)."""
    return _HELD.format(seconds)


def held_seconds(deferred: dict | None) -> float | None:
    """How long a stopped block held the model's thread, from an error's wire form; None for any other error."""
    if not deferred or deferred.get("type_name") != BlockTimeoutError.__name__:
        return None
    found = _HELD_PATTERN.search(str(deferred.get("message") or ""))
    return float(found.group(1)) if found else None


def intervention_error(deferred: dict, message: str) -> RequestError:
    """The exception to raise at the caller for an intervention that failed in the engine.

    nnsight 0.8.1 re-raises a worker's exception as a plain ``RuntimeError`` whose
    message starts with the original type name (``"ValueError: boom"``), because
    the exception object itself does not cross the process boundary. When the
    original type is a builtin exception (``ValueError``, ``IndexError``,
    ``KeyError``, ...), this returns an instance of a class deriving from both
    :class:`~nnsight_ray.errors.RequestError` (so still a ``RuntimeError``,
    nnsight's contract, with the same message) and that builtin type, so
    ``except ValueError`` at the caller works as it would on a local model.
    Other types (nnsight's own, user-defined) come back as ``RequestError``.

    The error keeps nnsight's wire form as ``.deferred`` (type name, message,
    intervention traceback) and pickles, so it can be raised in one process
    (a merge actor) and caught, typed, in another (``ray.get`` of its ref).
    """
    error = _typed_class(deferred.get("type_name") or "Exception")(message)
    error.deferred = dict(deferred)
    return error


def _typed_class(name: str) -> type[RequestError]:
    if name in _TYPED_ERRORS:
        return _TYPED_ERRORS[name]
    original = getattr(builtins, name, None)
    if (
        not (isinstance(original, type) and issubclass(original, Exception))
        or issubclass(RequestError, original)  # RuntimeError, Exception: already one
        or issubclass(original, (StopIteration, StopAsyncIteration))  # iteration protocol, not errors
    ):
        return RequestError
    cls = _TYPED_ERRORS.get(name)
    if cls is None:
        try:
            cls = type(name, (RequestError, original), {"__str__": _str, "__reduce__": _reduce_typed,
                                                        "__module__": __name__})
        except TypeError:  # instance layout conflict with RuntimeError
            cls = RequestError
        _TYPED_ERRORS[name] = cls
    return cls


def _reduce_typed(self: RequestError) -> Any:
    # The class is made at run time (no importable name): rebuild it by its type name.
    return _rebuild_typed, (type(self).__name__, self.args), dict(self.__dict__)


def _rebuild_typed(name: str, args: tuple) -> RequestError:
    return _typed_class(name)(*args)


def raise_intervention(deferred: dict | None) -> None:
    """nnsight's ``raise_deferred`` with the typed exception of `intervention_error`."""
    from nnsight.intervention.errors import raise_deferred

    try:
        raise_deferred(deferred)
    except RuntimeError as exc:
        if isinstance(exc, RequestError):
            raise
        raise intervention_error(deferred, str(exc)) from None
