"""``LocalVLLM``: nnsight's in-process vLLM model, on CPU as on GPU.

nnsight 0.8.1's ``VLLM`` names a GPU-only worker and its meta build calls an
accelerator API, so on vLLM's CPU build it cannot build even the client-side
meta tree. ``LocalVLLM`` is the same class with two supported seams changed:
the ``worker_cls`` it hands vLLM (chosen by vLLM's platform, see
``nnsight_ray._internal.engine.platform``) and the meta build, which runs under a
scoped accelerator stand-in on accelerator-less machines. One addition: an
intervention that fails in the engine is re-raised with its original builtin
type as well as nnsight's ``RuntimeError`` (see ``intervention_error``).
Everything else (trace, invokes, iter/all, edits, ``model.edit()``,
``mode="async"``, ``serve=``) is nnsight's own code.

With ``distributed_executor_backend="ray"`` the engine's ranks are Ray actors
placed by a placement group on any node of a Ray cluster (see
``nnsight_ray._internal.ranks.executor``), on CPU and GPU alike.
"""

from __future__ import annotations

import os
import time
from typing import Any

from nnsight.modeling.vllm import VLLM

from ._internal.blocks import graphs, skip
from ._internal.engine import platform
from ._internal.ranks import limits
from .errors import RequestError, intervention_error, raise_intervention

__all__ = ["LocalVLLM", "intervention_error", "raise_intervention"]

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

    def _load_meta(self, repo_id: str, **kwargs: Any) -> Any:
        # Ray-executor options shape the ranks, not the meta tree.
        from ._internal.cluster.placement import split_ray_options

        kwargs, _ = split_ray_options(kwargs)
        kwargs = {key: value for key, value in kwargs.items() if key not in limits.ENGINE_KEYS}
        with platform.meta_build_without_accelerator():
            return super()._load_meta(repo_id, **kwargs)

    def _load(self, repo_id: str, **kwargs: Any) -> Any:
        from ._internal.cluster.placement import release_placement_group
        from ._internal.ranks.executor import configure_engine_kwargs

        # vLLM reads these in this process and the ones it starts (platform.ENGINE_ENV_DEFAULTS).
        for key, value in platform.engine_env().items():
            os.environ.setdefault(key, value)
        kwargs = configure_engine_kwargs(limits.engine_limits(platform.engine_defaults(kwargs)))
        self._engine_kwargs = kwargs
        # enforce_eager=False without taps: graphs on the steps no block needs
        # (``_internal/blocks/graphs.py``); nnsight's VLLM would refuse it, so it is taken here.
        asked = kwargs.pop("enforce_eager", None)
        if asked and self.taps:
            raise ValueError(f"enforce_eager=True contradicts taps={list(self.taps)!r}: taps are served from "
                             "CUDA graphs. Drop one of them.")
        self._graphs = bool(self.taps) or asked is False
        if self._graphs and not self.taps:
            os.environ.update(graphs.BREAKABLE_ENV)  # nnsight sets it for taps; the engine processes inherit it
        try:
            return super()._load(repo_id, **kwargs)
        except BaseException:
            release_placement_group(kwargs)
            raise

    def _load_sync(self, repo_id: str, **kwargs: Any) -> Any:
        """nnsight's sync engine (``vllm.LLM``), with graphs when taps or ``enforce_eager=False`` ask for them."""
        from nnsight.modeling.vllm.engines.engine import NNsightLLMEngine
        from vllm import LLM

        llm = LLM(repo_id, worker_cls=self._WORKER_CLS, enforce_eager=not self._graphs, **kwargs)
        llm.llm_engine.__class__ = NNsightLLMEngine  # as nnsight's _load_sync: step() collects saves
        return llm

    def _load_async(self, repo_id: str, **kwargs: Any) -> Any:
        """nnsight's async engine, resolved with ``vllm.LLM``'s defaults (``_internal/engine/parity.py``).

        nnsight builds ``AsyncLLM`` from bare ``AsyncEngineArgs``, whose usage
        context no default table names (128 sequences / 2048 tokens a step on an
        H200, against ``LLM``'s 1024 / 16384); the sync engine is ``LLM`` itself.
        """
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from ._internal.engine.parity import OFFLINE, entrypoint_kwargs

        kwargs["enforce_eager"] = not self._graphs  # see _load
        kwargs, _ = entrypoint_kwargs(kwargs, OFFLINE)
        return AsyncLLM.from_engine_args(AsyncEngineArgs(model=repo_id, worker_cls=self._WORKER_CLS, **kwargs),
                                         usage_context=UsageContext.LLM_CLASS)

    def _pipeline_stages(self) -> int:
        return int((self.__dict__.get("_engine_kwargs") or {}).get("pipeline_parallel_size") or 1)

    def _batch(self, invokes: list[tuple], fn: Any) -> tuple:
        # An invoke's (or a direct-input trace's) block limits are ours, not SamplingParams fields.
        cleaned, asked = [], []
        for inputs, kwargs in invokes:
            kwargs = dict(kwargs)
            asked.append(limits.request_limits(kwargs))
            cleaned.append((inputs, kwargs))
        (prompts, params, loras), rest = super()._batch(cleaned, fn)
        for param, mine in zip(params, asked):
            if mine:
                param.nnsight_ray_limits = mine
        return (prompts, params, loras), rest

    def _attach_mediators(self, params: list, **kwargs: Any) -> list:
        # Each request names the ranks' own envoy tree rather than carrying a
        # copy, where the ranks' tree is this one (see `_internal.envoy_refs`).
        # A loop of invokes shares one block: it is reduced to source once (see `_internal.shared_blocks`).
        from contextlib import nullcontext

        from ._internal.blocks import envoy_refs
        from ._internal.blocks.shared_blocks import one_object_per_payload, shared_reductions
        from ._internal.observe.timeline import ATTACHED, CALLER

        began = time.monotonic()
        asked = limits.request_limits(kwargs)  # trace(..., block_timeout_s=...): checked on the rank, against its max
        refs = envoy_refs.same_tree_as_ranks(self, self._pipeline_stages())
        with shared_reductions(self.interleaver.mediators), envoy_refs.by_reference(self) if refs else nullcontext():
            mediators = super()._attach_mediators(params, **kwargs)
        one_object_per_payload(params)
        for param in params:
            mine = {**asked, **getattr(param, "nnsight_ray_limits", {})}
            if mine:
                param.extra_args = {**(param.extra_args or {}), limits.LIMITS_KEY: mine}
        CALLER.mark(ATTACHED, len(params), began)
        return mediators

    def step_modes(self) -> list[dict[str, int]]:
        """How each rank's steps ran, in rank order: ``graph`` (a full CUDA graph), ``piecewise`` (breakable
        graphs serving taps), ``eager_for_block`` (eager because a block waited on a location no graph
        serves), ``eager`` (vLLM's own choice: an eager engine, or a batch larger than any graph)."""
        return self.vllm_entrypoint.collective_rpc("nnsight_ray_step_modes")

    def topology(self) -> list[dict[str, Any]]:
        """Each rank's pp rank, tp rank, pid, node id and actor name, in rank order (as ``RayVLLM.topology``).

        On Ray ranks (``distributed_executor_backend="ray"``) node ids and actor
        names are Ray's; under vLLM's own executors they are ``None``.
        """
        if getattr(self, "vllm_entrypoint", None) is None:
            raise RequestError("this LocalVLLM has no engine (built without dispatch=True): no ranks to describe")
        ranks = self.vllm_entrypoint.collective_rpc("nnsight_ray_describe")
        return sorted(ranks, key=lambda rank: rank["rank"])

    def shutdown(self) -> None:
        """Stop the engine (its core process, any Ray rank actors) and free what it reserved.

        With ``distributed_executor_backend="ray"`` the ranks' placement group
        is reserved in this process (see ``ranks/executor.py``'s ``configure_engine_kwargs``), so it
        outlives the engine core unless released here. Safe to call twice.
        """
        from ._internal.cluster.placement import release_placement_group

        engine, self.vllm_entrypoint = getattr(self, "vllm_entrypoint", None), None
        if engine is not None:
            try:
                if hasattr(engine, "shutdown"):  # AsyncLLM (mode="async")
                    engine.shutdown()
                else:  # vllm.LLM
                    engine.llm_engine.engine_core.shutdown()
            except Exception:  # the engine core already died
                pass
        kwargs, self._engine_kwargs = self.__dict__.get("_engine_kwargs"), None
        if kwargs:
            release_placement_group(kwargs)

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        # The async engine's streaming backend, with the same typed errors as
        # the sync path (nnsight picks the same backend under the same test).
        if (
            self._async_engine
            and kwargs.get("backend") is None
            and not kwargs.get("remote")
            and kwargs.get("serve") is None
        ):
            kwargs["backend"] = _TypedErrorAsyncBackend(self)
        # nnsight's tracer, its bodies skipped without sys.settrace on Python 3.12+ (``blocks.skip``).
        skipping = skip.tracer_cls()
        if skipping is not None:
            kwargs.setdefault("tracer_cls", skipping)
        return super().trace(*inputs, **kwargs)

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


def _make_async_backend() -> type:
    from nnsight.modeling.vllm.async_backend import AsyncVLLMBackend

    class TypedErrorAsyncBackend(AsyncVLLMBackend):
        """nnsight's async trace backend, raising failed interventions with their type."""

        async def _attach_saves(self, output: Any) -> None:
            try:
                await super()._attach_saves(output)
            except RuntimeError as exc:
                deferred = getattr(output, "nnsight_error", None)
                if not deferred or deferred.get("is_control_flow") or isinstance(exc, RequestError):
                    raise
                raise intervention_error(deferred, str(exc)) from None

    return TypedErrorAsyncBackend


_TypedErrorAsyncBackend = _make_async_backend()
