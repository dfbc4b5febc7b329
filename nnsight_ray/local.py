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

from typing import Any

from nnsight.modeling.vllm import VLLM

from ._internal import platform

__all__ = ["LocalVLLM"]


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
