"""``build_processor`` for ``NNsightEngineProcessorConfig``, registered with Ray Data LLM's builder registry.

``ray.data.llm.build_processor(config, preprocess=..., postprocess=...)``
looks its builder up by the config's type (``ProcessorBuilder.register``);
importing ``nnsight_ray.data`` registers ``build_nnsight_engine_processor``
for ``NNsightEngineProcessorConfig``, so Ray's own ``build_processor`` builds
it. ``nnsight_ray.data.build_processor`` is the same call without the registry.

The processor is Ray Data LLM's ``Processor``: preprocess (a ``map``), the
engine stage (``map_batches`` on an actor pool; with rank actors, which is at
TP x PP > 1, for an activation dataset, and whenever an actor takes several
batches at once, each actor in a placement group of its own, see ``placement``), postprocess (a ``map``; the
saved values reach it as ndarrays). Before anything is built, a preflight as
the batch config's (``batch.preflight``, ``batch.interventions``): vLLM's
engine argument names, each save location on nnsight's meta tree of the model,
or the intervention file loaded and checked; a mistake fails here, in seconds,
not in an actor after an engine started.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ray.llm._internal.batch.processor.base import Processor, ProcessorBuilder

from .columns import with_arrays
from .config import NNsightEngineProcessorConfig
from .placement import EngineGroups, rank_placement
from .stage import NNsightEngineStage

__all__ = ["build_nnsight_engine_processor", "build_processor", "intervention_fn", "preflight", "register"]


def intervention_fn(config: NNsightEngineProcessorConfig) -> Callable | None:
    """What each invoke calls for ``config.intervention``: ``run_intervention`` over the user's ``intervene``.

    A ``.py`` path is loaded as a batch run loads it (``load_intervention``:
    checked now; shipped by value, so the engines' nodes need no copy).
    """
    from ..batch.interventions import load_intervention, run_intervention

    if config.intervention is None:
        return None
    if isinstance(config.intervention, str):
        fn, _ = load_intervention(config.intervention)
        return fn
    return functools.partial(run_intervention, intervene=config.intervention)


def preflight(config: NNsightEngineProcessorConfig) -> None:
    """What needs vLLM, checked before any engine starts: engine arguments, and saves (or an activation dataset's
    locations) on the model's meta tree."""
    from ..batch.interventions import resolve_saves
    from ..batch.preflight import _check_engine_kwargs, _meta_module

    from .config import SaveSpec

    _check_engine_kwargs(config.engine_kwargs)
    saves = config.saves or [SaveSpec(location=location, tokens="all")
                             for location in (config.activations.locations if config.activations else [])]
    if saves:
        resolve_saves(_meta_module(config.model_source, config.engine_kwargs), saves)


def stage_map_kwargs(config: NNsightEngineProcessorConfig) -> dict[str, Any]:
    """``map_batches`` arguments of the engine stage, as Ray Data LLM's vLLM processor sets them.

    With rank actors (``config.rank_actors``), as its vLLM
    stage does with the Ray executor: the actor reserves no GPU itself
    (``num_gpus=0``), and ``ray_remote_args_fn`` places each actor in a
    placement group of its own, which its engine's ranks then take
    (``placement``). Connected to running engines (``engine_name``), an
    actor is a client only: no GPU, no group, ``num_cpus`` as set.
    """
    import ray

    kwargs: dict[str, Any] = dict(
        zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(**config.get_concurrency(autoscaling_enabled=True),
                                           max_tasks_in_flight_per_actor=config.max_tasks_in_flight_per_actor),
        # Batches an actor takes at once; its traces still run one at a time, on its tracing thread.
        max_concurrency=config.max_concurrent_batches,
        num_cpus=config.num_cpus,
        num_gpus=config.gpus(),
    )
    if config.rank_actors:
        bundles, strategy = config.rank_bundles()
        kwargs.update(num_gpus=0, ray_remote_args_fn=EngineGroups(bundles, strategy))
    if config.engine_name is not None:
        kwargs["num_gpus"] = 0
    elif config.accelerator_type:
        kwargs["accelerator_type"] = config.accelerator_type
    if config.runtime_env:
        kwargs["runtime_env"] = config.runtime_env
    return kwargs


def build_nnsight_engine_processor(config: NNsightEngineProcessorConfig, preprocess: Callable | None = None,
                                   postprocess: Callable | None = None,
                                   preprocess_map_kwargs: dict[str, Any] | None = None,
                                   postprocess_map_kwargs: dict[str, Any] | None = None,
                                   check: bool = True) -> Processor:
    """The processor of ``config``; ``check=False`` skips the preflight (``builder_kwargs={"check": False}``)."""
    fn = intervention_fn(config)
    if check:
        preflight(config)
    stage = NNsightEngineStage(
        fn_constructor_kwargs=dict(
            model_source=config.model_source,
            engine_kwargs=config.started_engine_kwargs(),
            saves=[spec.model_dump() for spec in config.saves] if config.saves else None,
            intervene=fn,
            should_continue_on_error=config.should_continue_on_error,
            placement=rank_placement(config.rank_bundles()[0], config.world_size) if config.rank_actors else None,
            activations=config.activations.model_dump() if config.activations else None,
            max_concurrent_batches=config.max_concurrent_batches,
            engine_names=config.engine_names,
        ),
        map_batches_kwargs=stage_map_kwargs(config),
    )
    return Processor(config, [stage], preprocess=preprocess, postprocess=with_arrays(postprocess),
                     preprocess_map_kwargs=preprocess_map_kwargs, postprocess_map_kwargs=postprocess_map_kwargs)


def build_processor(config: NNsightEngineProcessorConfig, preprocess: Callable | None = None,
                    postprocess: Callable | None = None, preprocess_map_kwargs: dict[str, Any] | None = None,
                    postprocess_map_kwargs: dict[str, Any] | None = None,
                    builder_kwargs: dict[str, Any] | None = None) -> Processor:
    """``ray.data.llm.build_processor`` for this config, without going through Ray's registry."""
    if not isinstance(config, NNsightEngineProcessorConfig):
        raise TypeError(f"expected an NNsightEngineProcessorConfig, got {type(config).__name__}; "
                        "for Ray's own configs use ray.data.llm.build_processor")
    ProcessorBuilder.validate_builder_kwargs(builder_kwargs)
    return build_nnsight_engine_processor(config, preprocess=preprocess, postprocess=postprocess,
                                          preprocess_map_kwargs=preprocess_map_kwargs,
                                          postprocess_map_kwargs=postprocess_map_kwargs, **(builder_kwargs or {}))


def register() -> None:
    """Register the builder with Ray Data LLM's registry (keyed by the config's class name); idempotent."""
    if NNsightEngineProcessorConfig.__name__ not in ProcessorBuilder._registry:
        ProcessorBuilder.register(NNsightEngineProcessorConfig, build_nnsight_engine_processor)


register()
