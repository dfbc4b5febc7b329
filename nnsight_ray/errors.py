"""Every error nnsight_ray raises on purpose, and whether it is recoverable."""

from __future__ import annotations


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
