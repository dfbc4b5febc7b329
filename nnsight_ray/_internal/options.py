"""Validated options for placing an engine's ranks on a Ray cluster.

They travel from the user's call (``LocalVLLM(...)``, ``RayVLLM(...)``, a batch
config) to the executor, which vLLM builds inside its engine-core process from
the ``VllmConfig`` alone. They therefore ride ``VllmConfig.additional_config``
(a plain dict vLLM carries everywhere) under one key, as JSON-able values.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

ADDITIONAL_CONFIG_KEY = "nnsight_ray"
NAMESPACE = "nnsight_ray"
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RankPlacement(BaseModel):
    """Where and how each tensor/pipeline-parallel rank actor runs."""

    model_config = ConfigDict(extra="forbid")

    placement_strategy: PlacementStrategy = Field(
        "PACK", description="Ray placement-group strategy for the rank bundles."
    )
    placement_group_id: str | None = Field(
        None, description="Hex id of an existing placement group to use (one bundle per rank, in rank order)."
    )
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="What each rank's bundle reserves besides CPUs: 'gpu' one accelerator "
        "(`gpu_resource`), 'cpu' none; 'auto' picks 'gpu' when the cluster has any `gpu_resource`."
    )
    gpu_resource: str = Field("GPU", description="Ray resource name of the accelerator (vLLM's ray_device_key).")
    cpus_per_rank: float = Field(1.0, ge=0, description="CPUs each rank's bundle reserves.")
    gpus_per_rank: float = Field(1.0, ge=0, description="GPUs each rank's bundle reserves (GPU platforms only).")
    placement_timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for the placement group before failing with what the cluster has."
    )
    engine_name: str | None = Field(
        None, description="Prefix of the rank actors' names; defaults to vLLM's instance id."
    )
    ray_address: str | None = Field(
        None, description="GCS address the engine-core process joins; defaults to the caller's cluster."
    )
    owns_placement_group: bool = Field(
        False, description="Internal: the executor removes the placement group at shutdown (we created it)."
    )
    cpu_binding: str = Field(
        "auto",
        description="CPU platform: 'auto' splits each host's cores among its ranks, 'nobind' leaves threads alone, "
        "or an explicit per-rank list like '0|1' (vLLM's VLLM_CPU_OMP_THREADS_BIND syntax).",
    )


RAY_OPTION_NAMES = frozenset(RankPlacement.model_fields) | {"placement_group"}


def split_ray_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate this project's placement options from vLLM's engine kwargs."""
    engine = {k: v for k, v in kwargs.items() if k not in RAY_OPTION_NAMES}
    ray_options = {k: v for k, v in kwargs.items() if k in RAY_OPTION_NAMES}
    return engine, ray_options


def connect_ray(address: str | None = None) -> str:
    """Join the cluster at ``address``/``RAY_ADDRESS``, or start a local one on 127.0.0.1.

    Returns the GCS address, which the engine-core process (a separate process
    vLLM spawns) uses to join the same cluster.
    """
    import ray

    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address and address.startswith(("ray://", "http://", "https://")):
            raise ValueError(
                f"RAY_ADDRESS={address!r}: nnsight_ray runs on a cluster node (or a Ray job) and joins "
                "through the GCS address (host:6379, or 'auto'); Ray Client (ray://) and the dashboard "
                "address (http://) cannot host the engine core's rank actors. Submit a Ray job instead "
                "(scripts/submit_batch.py, `ray job submit`)."
            )
        if address:
            ray.init(address=address, namespace=NAMESPACE)
        else:
            ray.init(namespace=NAMESPACE, include_dashboard=False, _node_ip_address="127.0.0.1")
    return ray.get_runtime_context().gcs_address


def resolve_device(placement: RankPlacement) -> RankPlacement:
    """``device="auto"``: 'gpu' when the cluster has any ``gpu_resource``, else 'cpu' (in place)."""
    if placement.device == "auto":
        import ray

        placement.device = "gpu" if ray.cluster_resources().get(placement.gpu_resource, 0) > 0 else "cpu"
    return placement


def configure_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Turn ``distributed_executor_backend="ray"`` plus our options into vLLM engine kwargs.

    Reserves the ranks' placement group unless the caller gave one; release it
    with ``release_placement_group`` if the engine then fails to start.
    """
    engine, ray_options = split_ray_options(kwargs)
    if engine.get("distributed_executor_backend") != "ray":
        if ray_options:
            raise ValueError(
                f"{sorted(ray_options)} only apply with distributed_executor_backend='ray'; "
                "add it, or drop these options."
            )
        return engine
    from .ray_executor import NNsightRayExecutor

    pg = ray_options.pop("placement_group", None)
    if pg is not None:
        ray_options["placement_group_id"] = pg.id.hex()
    placement = RankPlacement(**ray_options)
    if placement.ray_address is None:
        placement.ray_address = connect_ray()
    resolve_device(placement)
    # Reserved here, in the caller, so an unsatisfiable layout fails fast with a
    # message that reaches the user, instead of inside vLLM's engine core, whose
    # start-up failure only says "see root cause above".
    placement = reserve_placement_group(placement, engine)
    # The class, not its import path: vLLM reads `supports_pp` off it before it
    # would resolve a path, and refuses pipeline parallelism otherwise.
    engine["distributed_executor_backend"] = NNsightRayExecutor
    engine["additional_config"] = {
        **(engine.get("additional_config") or {}),
        ADDITIONAL_CONFIG_KEY: placement.model_dump(),
    }
    return engine


def reserve_placement_group(placement: RankPlacement, engine_kwargs: dict[str, Any],
                            detached: bool = False) -> RankPlacement:
    """``placement`` holding its own reserved group (``owns_placement_group``), unless it names one already.

    The group lives as long as its deployment: ``detached`` only for a detached
    deployment (removed at its shutdown); otherwise Ray removes it with the
    process (driver or actor) that reserved it, even one killed outright.
    """
    if placement.placement_group_id is not None:
        return placement
    world = int(engine_kwargs.get("tensor_parallel_size", 1)) * int(engine_kwargs.get("pipeline_parallel_size", 1))
    pg, _ = acquire_placement_group(world, resolve_device(placement), detached=detached)
    return placement.model_copy(update={"placement_group_id": pg.id.hex(), "owns_placement_group": True})


def _bundles(world_size: int, placement: RankPlacement) -> list[dict[str, float]]:
    bundle: dict[str, float] = {"CPU": placement.cpus_per_rank}
    if placement.device == "gpu":
        bundle[placement.gpu_resource] = placement.gpus_per_rank
    return [dict(bundle) for _ in range(world_size)]


def acquire_placement_group(world_size: int, placement: RankPlacement, detached: bool = False):
    """The rank bundles' placement group and whether we created it (and must remove it).

    A group created here is scoped to this process (its job, or the actor it
    runs in) unless ``detached``.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from ..errors import PlacementError

    if placement.placement_group_id:
        pg = placement_group_by_id(placement.placement_group_id)
        ray.get(pg.ready(), timeout=placement.placement_timeout_s)
        if len(pg.bundle_specs) < world_size:
            raise PlacementError(
                f"placement group {placement.placement_group_id} has {len(pg.bundle_specs)} bundles, "
                f"but tensor_parallel_size x pipeline_parallel_size = {world_size} ranks need one each."
            )
        return pg, False
    bundles = _bundles(world_size, placement)
    # Detached only for a detached deployment, which outlives the job that
    # reserved it (deploy.shutdown removes it); any other is Ray's to remove
    # with its creator, so a killed driver leaves nothing reserved.
    pg = placement_group(bundles, strategy=placement.placement_strategy, lifetime="detached" if detached else None,
                         name=placement_group_name(placement.engine_name) if placement.engine_name else "")
    ready, _ = ray.wait([pg.ready()], timeout=placement.placement_timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"could not place {world_size} rank bundles {bundles[0]} with strategy "
            f"{placement.placement_strategy} within {placement.placement_timeout_s:.0f}s. "
            f"Cluster total: {ray.cluster_resources()}; available now: {ray.available_resources()}; "
            f"nodes: {sum(1 for n in ray.nodes() if n['Alive'])}. Lower cpus_per_rank/gpus_per_rank, "
            "use a looser strategy (PACK/SPREAD), add nodes, or raise placement_timeout_s. Check `ray status`."
        )
    return pg, True


def placement_group_by_id(hex_id: str):
    """A handle on an existing placement group from its hex id."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    return PlacementGroup(PlacementGroupID(bytes.fromhex(hex_id)))


def placement_group_name(engine_name: str) -> str:
    """The readable name of a deployment's rank placement group (``ray status``, leak checks)."""
    return f"{engine_name}.ranks"


def remove_named_placement_groups(name: str) -> int:
    """Remove every live placement group called ``name`` (any namespace); how many were removed.

    A backstop for a detached deployment whose engine was killed before its
    executor could remove the group (nothing else would), and how the next
    deployment of that name reclaims one left behind.
    """
    import ray
    from ray.util.placement_group import remove_placement_group

    removed = 0
    for hex_id, entry in ray.util.placement_group_table().items():
        if entry.get("name") == name and entry.get("state") in ("CREATED", "PENDING", "RESCHEDULING"):
            try:
                remove_placement_group(placement_group_by_id(hex_id))
                removed += 1
            except Exception:  # removed meanwhile
                logger.debug("could not remove placement group %s", hex_id, exc_info=True)
    return removed


def release_placement_group(engine_kwargs: dict[str, Any]) -> None:
    """Remove the placement group ``configure_engine_kwargs`` reserved, if it did."""
    placement = (engine_kwargs.get("additional_config") or {}).get(ADDITIONAL_CONFIG_KEY)
    if not placement or not placement.get("owns_placement_group") or not placement.get("placement_group_id"):
        return
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(placement_group_by_id(placement["placement_group_id"]))
    except Exception:
        pass
