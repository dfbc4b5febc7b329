"""Rank actors (TP x PP > 1, an activation dataset, or several batches in flight per actor): one placement group per
engine actor, shared by the actor and its engine's ranks.

As Ray Data LLM's vLLM stage does it (``vllm_engine_stage._ray_scheduling_strategy_fn``):
the engine stage's ``ray_remote_args_fn`` (``EngineGroups``), which Ray Data
calls in the driver each time its actor pool starts an actor, reserves one
group of ``tp x pp`` rank bundles and schedules that actor inside it with
``placement_group_capture_child_tasks``. In the actor, ``start_engine`` hands
that group to ``RayVLLM`` as a caller's group (``placement_group=``, the seam
``tests/integration/test_user_placement.py`` tests): rank ``r`` takes bundle
``r``, and the engine and merge actors (no resources) are captured into it.

Nothing outlives the pool: when Ray Data lets an actor go (the dataset
consumed, or the pool scaling down), ``stop_engine`` shuts its ``RayVLLM``
down (engine, merge and rank actors) and then removes the actor's group,
which ends the actor itself. The group is the driver's (reserved in
``ray_remote_args_fn``), so an actor Ray Data kills outright, or drops
before its constructor returned, leaves its group reserved until the driver
exits, as Ray Data LLM's does; its actors go with it (Ray's owner
fate-sharing).
"""

from __future__ import annotations

import logging
import sys
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["EngineGroups", "rank_bundles", "rank_placement", "start_engine", "starting_an_actor", "stop_engine"]

logger = logging.getLogger(__name__)


def rank_bundles(world_size: int, placement_group_config: dict[str, Any] | None, num_gpus: float,
                 accelerator_type: str | None = None) -> tuple[list[dict[str, float]], str]:
    """The group of one engine: its bundles (one per rank, or the config's ``bundles``) and its strategy.

    ``placement_group_config`` is Ray Data LLM's (``bundle_per_worker``, repeated
    ``world_size`` times, or ``bundles``; ``strategy``, default ``PACK``). Without
    it, each rank's bundle is one CPU and ``num_gpus`` GPUs (none on a CPU
    cluster). An ``accelerator_type`` adds its label resource to every
    bundle, as Ray Data LLM does. Zero amounts are left out (Ray refuses them).
    """
    config = dict(placement_group_config or {})
    strategy = config.get("strategy") or "PACK"
    if config.get("bundles"):
        bundles = [dict(bundle) for bundle in config["bundles"]]
    else:
        bundle = config.get("bundle_per_worker") or {"CPU": 1.0, "GPU": num_gpus}
        bundles = [dict(bundle) for _ in range(world_size)]
    if accelerator_type:
        for bundle in bundles:
            bundle[f"accelerator_type:{accelerator_type}"] = 0.001
    bundles = [{key: float(amount) for key, amount in bundle.items() if amount} for bundle in bundles]
    if len(bundles) < world_size:
        raise ValueError(f"placement_group_config: {len(bundles)} bundles for tensor_parallel_size x "
                         f"pipeline_parallel_size = {world_size} ranks; give one bundle per rank at least")
    if not all(bundles):
        raise ValueError(f"placement_group_config: every bundle needs a resource; got {bundles}")
    return bundles, strategy


def rank_placement(bundles: list[dict[str, float]], world_size: int) -> dict[str, Any]:
    """``RankPlacement`` settings of the ranks in these bundles: a GPU each if their bundles hold GPUs, else CPU."""
    gpus = min(bundle.get("GPU", 0.0) for bundle in bundles[:world_size])
    return {"device": "gpu", "gpus_per_rank": gpus} if gpus > 0 else {"device": "cpu"}


@dataclass
class EngineGroups:
    """Ray Data's ``ray_remote_args_fn`` of the engine stage: a fresh group per actor, the actor inside it."""

    bundles: list[dict[str, float]]
    strategy: str = "PACK"

    def __call__(self) -> dict[str, Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not starting_an_actor():
            return {}
        group = ray.util.placement_group([dict(bundle) for bundle in self.bundles], strategy=self.strategy)
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_capture_child_tasks=True)}


#: The method of Ray Data's actor pool operator that calls ``ray_remote_args_fn`` to start an actor.
STARTS_AN_ACTOR = "_merge_ray_remote_args"


def starting_an_actor(depth: int = 8) -> bool:
    """Whether Ray Data calls ``ray_remote_args_fn`` to start an actor (``ActorPoolMapOperator._merge_ray_remote_args``).

    Ray Data 2.60 calls it once more at each execution's start, from its
    high-memory issue detector (``_get_dynamic_ray_remote_args``, for the
    ``memory`` key), with no actor to place: a group reserved there would stay
    reserved, unused, until the driver exits (Ray Data LLM's vLLM stage
    reserves one so per pipeline). Should a Ray upgrade rename the method, no
    group is reserved here and each engine reserves its own (``start_engine``),
    released at its shutdown; ``tests/unit/test_data_unit.py`` pins the name.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == STARTS_AN_ACTOR:
            return True
        frame = frame.f_back
    return False


def start_engine(model_source: str, engine_kwargs: dict[str, Any], placement: dict[str, Any] | None) -> Any:
    """A ``RayVLLM`` whose ranks take the bundles of the group this actor runs in.

    In no group (see ``starting_an_actor``), the engine reserves its own, of
    one CPU (and ``gpus_per_rank`` GPUs) a rank, and removes it at shutdown.
    """
    import ray

    from ..ray_vllm import RayVLLM

    group = ray.util.get_current_placement_group()
    kwargs = dict(engine_kwargs, **(placement or {}))
    if group is not None:
        kwargs["placement_group"] = group
    return RayVLLM(model_source, name=f"data-{uuid.uuid4().hex[:8]}", **kwargs)


def stop_engine(model: Any) -> None:
    """Shut ``model`` down; then, for a ``RayVLLM`` in this actor's group, remove the group (and this actor with it)."""
    shutdown = getattr(model, "shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
    except Exception:
        logger.warning("nnsight engine shutdown failed", exc_info=True)
    if type(model).__name__ != "RayVLLM":
        return
    import ray

    group = ray.util.get_current_placement_group()
    if group is not None:
        ray.util.remove_placement_group(group)  # the last thing this actor does
