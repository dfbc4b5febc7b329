"""``LocalVLLM``: nnsight's in-process vLLM model, on CPU as on GPU.

nnsight 0.8.1's ``VLLM`` names a GPU-only worker and its meta build calls an
accelerator API, so on vLLM's CPU build it cannot build even the client-side
meta tree. ``LocalVLLM`` is the same class with two supported seams changed:
the ``worker_cls`` it hands vLLM (chosen by vLLM's platform, see
``nnsight_ray._internal.platform``) and the meta build, which runs under a
scoped accelerator stand-in on accelerator-less machines. Everything else
(trace, invokes, iter/all, edits, ``model.edit()``, ``mode="async"``,
``serve=``) is nnsight's own code.

With ``distributed_executor_backend="ray"`` the engine's ranks are Ray actors
placed by a placement group on any node of a Ray cluster (see
``nnsight_ray._internal.ray_executor``), on CPU and GPU alike.
"""

from __future__ import annotations

import builtins
from typing import Any

from nnsight.modeling.vllm import VLLM

from ._internal import platform
from .errors import RequestError

__all__ = ["LocalVLLM", "intervention_error"]

# One class per builtin exception type, so `except ValueError` and identity
# checks see the same class every time.
_TYPED_ERRORS: dict[str, type[RequestError]] = {}


def _str(self: BaseException) -> str:
    # KeyError's own __str__ would repr() the multi-line message.
    return str(self.args[0]) if self.args else ""


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
    """
    name = deferred.get("type_name") or "Exception"
    original = getattr(builtins, name, None)
    if (
        not (isinstance(original, type) and issubclass(original, Exception))
        or issubclass(RequestError, original)  # RuntimeError, Exception: already one
        or issubclass(original, (StopIteration, StopAsyncIteration))  # iteration protocol, not errors
    ):
        return RequestError(message)
    cls = _TYPED_ERRORS.get(name)
    if cls is None:
        try:
            cls = type(name, (RequestError, original), {"__str__": _str, "__module__": __name__})
        except TypeError:  # instance layout conflict with RuntimeError
            cls = RequestError
        _TYPED_ERRORS[name] = cls
    return cls(message)


class LocalVLLM(VLLM):
    """nnsight's ``VLLM`` whose engine runs on this process's platform.

    Examples::

        model = LocalVLLM(path, dispatch=True)                 # CPU or GPU, in-process
        model = LocalVLLM(path)                                # meta-only client
        model = LocalVLLM(path, dispatch=True, tensor_parallel_size=2,
                          distributed_executor_backend="ray",
                          placement_strategy="STRICT_SPREAD")  # ranks as Ray actors
    """

    _WORKER_CLS = platform.worker_cls()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if platform.is_cpu():
            platform.apply_cpu_defaults()
        super().__init__(*args, **kwargs)

    def _load_meta(self, repo_id: str, **kwargs: Any) -> Any:
        # Ray-executor options shape the ranks, not the meta tree.
        from ._internal.options import split_ray_options

        kwargs, _ = split_ray_options(kwargs)
        with platform.meta_build_without_accelerator():
            return super()._load_meta(repo_id, **kwargs)

    def _load(self, repo_id: str, **kwargs: Any) -> Any:
        from ._internal.options import configure_engine_kwargs

        kwargs = configure_engine_kwargs(kwargs)
        return super()._load(repo_id, **kwargs)

    @staticmethod
    def _collect(mediators: list, outputs: list) -> None:
        # nnsight raises a failed intervention as a bare RuntimeError; re-raise
        # it with its original (builtin) type as well, see `intervention_error`.
        try:
            VLLM._collect(mediators, outputs)
        except RuntimeError as exc:
            deferred = next(
                (
                    error
                    for error in (getattr(output, "nnsight_error", None) for output in outputs)
                    if error and not error.get("is_control_flow")
                ),
                None,
            )
            if deferred is None or isinstance(exc, RequestError):
                raise
            raise intervention_error(deferred, str(exc)) from None
