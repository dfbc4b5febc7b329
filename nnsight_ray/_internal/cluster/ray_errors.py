"""Ray's wrapping of an actor's exception, taken off in one place.

An exception raised in an actor method reaches the caller as a
``RayTaskError`` (an instance of the original type too, with Ray's traceback
text around the message), possibly wrapped again when it crossed two actors;
``cause`` gives the exception the actor raised. A dead actor's
``RayActorError`` has no cause to give: ``cause`` turns it into
``EngineDeadError``, and callers that can say *which* actor died
(``RemoteEngine.unwrap``) do so before falling back to this.
"""

from __future__ import annotations

from typing import Any

from ...errors import EngineDeadError


def call_errors() -> tuple[type[BaseException], ...]:
    """What a failed actor call raises: ``(RayTaskError, RayActorError)``."""
    import ray

    return ray.exceptions.RayTaskError, ray.exceptions.RayActorError


def cause(error: BaseException) -> BaseException:
    """The exception an actor raised, without Ray's wrapping (however deep)."""
    import ray

    while isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        error = error.cause
    if isinstance(error, ray.exceptions.RayActorError):
        return EngineDeadError(f"the deployment's actor died: {error}")
    return error


def get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get`` raising what the actor raised (``cause``)."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except call_errors() as error:
        raise cause(error) from None
