"""Where an engine's ranks run: the user's `RankPlacement`, and the `PlacementPlan` built from it once.

The shape is ray.llm's (user config -> derived config). `RankPlacement` is
what a caller says (``LocalVLLM(...)`` / ``RayVLLM(...)`` keywords, a batch
config's ``engine`` section, Serve's ``build_app`` arguments): frozen,
validated where it enters. `plan_placement` turns it, once, in the process
that launches the engine, into a `PlacementPlan`: the device resolved, the
cluster's address, the world size and its bundles, and the placement group
reserved (or the caller's, checked). The plan is the only thing that rides
``VllmConfig.additional_config`` (a plain dict vLLM carries everywhere) to
the executor, which vLLM builds inside its engine-core process from the
``VllmConfig`` alone, and which only reads it.

No import of the executor here: the executor module (``ranks/executor.py``)
imports this one and sets itself as vLLM's backend
(``ranks/executor.py``'s ``configure_engine_kwargs``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

ADDITIONAL_CONFIG_KEY = "nnsight_ray"
NAMESPACE = "nnsight_ray"
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


EARLY_RANKS_ENV = "NNSIGHT_RAY_EARLY_RANKS"


class RankPlacement(BaseModel):
    """Where and how each tensor/pipeline-parallel rank actor runs (what the user asks for)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    cpu_binding: str = Field(
        "auto",
        description="CPU platform: 'auto' splits each host's cores among its ranks, 'nobind' leaves threads alone, "
        "or an explicit per-rank list like '0|1' (vLLM's VLLM_CPU_OMP_THREADS_BIND syntax).",
    )

    early_ranks: bool = Field(
        default_factory=lambda: os.environ.get(EARLY_RANKS_ENV, "1").strip().lower() not in ("0", "false", "no", "off"),
        description="Start the rank actors' processes before vLLM's engine core (each imports torch and vLLM "
        "while the core's process does) and have the executor adopt them. On by default (NNSIGHT_RAY_EARLY_RANKS=0 "
        "turns it off): on the H200 a TP=1 engine starts in 62-66 s with it against 87-99 s without "
        "(docs/performance.md, 'Engine start-up').",
    )

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "RankPlacement":
        """From the caller's keywords (`RAY_OPTION_NAMES`): a ``placement_group`` object becomes its hex id."""
        options = dict(options)
        pg = options.pop("placement_group", None)
        if pg is not None:
            options["placement_group_id"] = pg.id.hex()
        return cls(**options)

    def bundles(self, world_size: int) -> list[dict[str, float]]:
        """One bundle per rank: ``cpus_per_rank`` CPUs, plus ``gpus_per_rank`` of ``gpu_resource`` on 'gpu'."""
        bundle: dict[str, float] = {"CPU": self.cpus_per_rank}
        if self.device == "gpu":
            bundle[self.gpu_resource] = self.gpus_per_rank
        return [dict(bundle) for _ in range(world_size)]


#: The keywords of ``LocalVLLM`` / ``RayVLLM`` that are placement, not vLLM's.
RAY_OPTION_NAMES = frozenset(RankPlacement.model_fields) | {"placement_group"}


class PlacementPlan(BaseModel):
    """One engine's placement as decided at launch; what the executor reads (internal).

    Attributes:
        placement: The user's settings, with ``device`` resolved to 'cpu' or
            'gpu' and ``ray_address`` to the cluster's GCS address.
        world_size: ``tensor_parallel_size * pipeline_parallel_size``.
        placement_group_id: Hex id of the ranks' group (the caller's, or reserved here).
        owns_placement_group: Reserved by `plan_placement`: whoever stops the
            engine removes it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    placement: RankPlacement
    world_size: int = Field(ge=1)
    placement_group_id: str
    owns_placement_group: bool = False

    @property
    def bundles(self) -> list[dict[str, float]]:
        return self.placement.bundles(self.world_size)

    def as_config(self) -> dict[str, Any]:
        """JSON-able, for ``additional_config``."""
        return self.model_dump(mode="json")

    @classmethod
    def from_engine_kwargs(cls, engine_kwargs: dict[str, Any]) -> "PlacementPlan | None":
        """The plan riding ``engine_kwargs["additional_config"]`` (or a ``VllmConfig``'s), if any."""
        found = (engine_kwargs.get("additional_config") or {}).get(ADDITIONAL_CONFIG_KEY)
        return None if not found else cls.model_validate(found)


def world_size(engine_kwargs: dict[str, Any]) -> int:
    return int(engine_kwargs.get("tensor_parallel_size", 1)) * int(engine_kwargs.get("pipeline_parallel_size", 1))


def split_ray_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate this project's placement options from vLLM's engine kwargs."""
    engine = {k: v for k, v in kwargs.items() if k not in RAY_OPTION_NAMES}
    ray_options = {k: v for k, v in kwargs.items() if k in RAY_OPTION_NAMES}
    return engine, ray_options


def connect_ray(address: str | None = None) -> str:
    """Join the cluster at ``address``/``RAY_ADDRESS``, or start a local one.

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
                "(`nnsight-ray submit`, `ray job submit`)."
            )
        if address:
            ray.init(address=address, namespace=NAMESPACE)
        else:
            # No `_node_ip_address="127.0.0.1"` (a private keyword this passed
            # until Ray 2.60.0): Ray resolves a loopback address to the node's
            # routable IP anyway (`services.resolve_ip_for_localhost`), so it
            # changed nothing. Ray 2.60's only switch for loopback is an
            # environment variable read when `ray` is first imported; by now it
            # has been, so say what was started and how to keep it local.
            ray.init(namespace=NAMESPACE, include_dashboard=False)
            warn_if_reachable(ray.util.get_node_ip_address())
    return ray.get_runtime_context().gcs_address


def warn_if_reachable(node_ip: str) -> bool:
    """Warn (and say True) when a local Ray instance started here listens on a routable address.

    Its GCS and raylet then accept connections from other machines, and a
    connected Ray client can run code on this one.
    """
    import ipaddress

    try:
        if ipaddress.ip_address(node_ip).is_loopback:
            return False
    except ValueError:  # a host name
        pass
    logger.warning(
        "started a local Ray instance on %s, which other machines can reach (Ray binds the node's IP). "
        "To keep it on 127.0.0.1, set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before anything imports ray "
        "(as `make demo` and the tests do), or start your own cluster and set RAY_ADDRESS (docs/clusters.md).",
        node_ip)
    return True


def resolve_device(placement: RankPlacement) -> RankPlacement:
    """``device="auto"``: 'gpu' when the cluster has any ``gpu_resource``, else 'cpu' (a copy)."""
    if placement.device != "auto":
        return placement
    import ray

    device = "gpu" if ray.cluster_resources().get(placement.gpu_resource, 0) > 0 else "cpu"
    return placement.model_copy(update={"device": device})


def plan_placement(placement: RankPlacement, world_size: int, detached: bool = False) -> PlacementPlan:
    """Decide ``placement`` for ``world_size`` ranks, once: connect, resolve the device, reserve the group.

    Reserved here, in the launching process, so an unsatisfiable layout fails
    fast with a message that reaches the user, instead of inside vLLM's engine
    core, whose start-up failure only says "see root cause above". The group
    lives as long as its deployment: ``detached`` only for a detached
    deployment (removed at its shutdown); otherwise Ray removes it with the
    job that reserved it (a driver killed outright included); one reserved in
    an actor outlives that actor while its job lives, so it must be removed. A
    group the caller named is checked (ready, enough bundles), not reserved.
    """
    if placement.ray_address is None:
        placement = placement.model_copy(update={"ray_address": connect_ray()})
    else:
        connect_ray(placement.ray_address)
    placement = resolve_device(placement)
    reservation = RankReservation.reserve(placement, world_size, detached=detached)
    return PlacementPlan(placement=placement, world_size=world_size, placement_group_id=reservation.placement_group_id,
                         owns_placement_group=reservation.owned)


# Placement-group states in which a group still holds (or waits for) its resources.
_LIVE_GROUP_STATES = ("CREATED", "PENDING", "RESCHEDULING")


@dataclass(frozen=True)
class RankReservation:
    """The one owner of a deployment's rank placement group: reserve, release, reclaim by name.

    Every path that ends a group goes through here: a failed start
    (``deploy.wait_started``), ``deploy.shutdown``, the executor's shutdown in
    vLLM's engine core, ``LocalVLLM`` on a failed start, and ``deploy.launch``
    reclaiming a group an earlier deployment of that name left. Only an
    ``owned`` group (reserved by `reserve`, not the caller's) is ever removed.
    `release` is idempotent: the engine core and the caller may both release
    the same group, and only the first removes it.
    """

    placement_group_id: str
    owned: bool = False

    @classmethod
    def reserve(cls, placement: RankPlacement, world_size: int, detached: bool = False) -> "RankReservation":
        """The ranks' group: the caller's (checked), or one reserved now, named ``<engine>.ranks``.

        A group created here is scoped to this process's job unless ``detached``: a
        detached deployment outlives the job that reserved it (``deploy.shutdown``
        releases it); any other is Ray's to remove with its job, so a killed
        driver leaves nothing reserved (a killed actor's group stays until its
        job ends).
        """
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from ...errors import PlacementError

        if placement.placement_group_id:
            existing_placement_group(placement.placement_group_id, world_size, placement.placement_timeout_s)
            return cls(placement.placement_group_id, owned=False)
        bundles = placement.bundles(world_size)
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
        return cls(pg.id.hex(), owned=True)

    @classmethod
    def of(cls, plan: PlacementPlan) -> "RankReservation":
        """The reservation a launch planned (``plan_placement``)."""
        return cls(plan.placement_group_id, owned=plan.owns_placement_group)

    def release(self) -> bool:
        """Remove the group if it is ours and still live; True if this call removed it."""
        if not self.owned:
            return False
        import ray

        try:
            state = ray.util.placement_group_table(placement_group_by_id(self.placement_group_id)).get("state")
        except Exception:  # the cluster is gone, and the group with it
            logger.debug("could not read placement group %s", self.placement_group_id, exc_info=True)
            return False
        return state in _LIVE_GROUP_STATES and _remove(self.placement_group_id)

    @staticmethod
    def reclaim(name: str) -> int:
        """Remove every live placement group called ``name``, in any namespace; how many were removed.

        How a deployment reclaims the group of an earlier one of its name (a
        detached one whose actors were killed: nothing else would remove it).
        By the placement-group table, not ``ray.util.get_placement_group(name)``:
        in Ray 2.60.0 that looks the name up in the caller's namespace only
        (``get_placement_group_by_name(name, worker.namespace)``), and the
        reserving process may run in another (a user's own ``ray.init()``
        joins an anonymous namespace; a Serve replica, Serve's).
        """
        import ray

        return sum(_remove(hex_id) for hex_id, entry in ray.util.placement_group_table().items()
                   if entry.get("name") == name and entry.get("state") in _LIVE_GROUP_STATES)


def _remove(hex_id: str) -> bool:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(placement_group_by_id(hex_id))
        return True
    except Exception:  # removed meanwhile, or the cluster is gone
        logger.debug("could not remove placement group %s", hex_id, exc_info=True)
        return False


def existing_placement_group(hex_id: str, world_size: int, timeout_s: float):
    """The placement group ``hex_id``, once ready, checked to hold a bundle per rank."""
    import ray

    from ...errors import PlacementError

    pg = placement_group_by_id(hex_id)
    ray.get(pg.ready(), timeout=timeout_s)
    if len(pg.bundle_specs) < world_size:
        raise PlacementError(
            f"placement group {hex_id} has {len(pg.bundle_specs)} bundles, "
            f"but tensor_parallel_size x pipeline_parallel_size = {world_size} ranks need one each."
        )
    return pg


def placement_group_by_id(hex_id: str):
    """A handle on an existing placement group from its hex id (public: ``ray.PlacementGroupID``)."""
    import ray
    from ray.util.placement_group import PlacementGroup

    return PlacementGroup(ray.PlacementGroupID.from_hex(hex_id))


def placement_group_name(engine_name: str) -> str:
    """The readable name of a deployment's rank placement group (``ray status``, leak checks)."""
    return f"{engine_name}.ranks"


def release_placement_group(engine_kwargs: dict[str, Any]) -> None:
    """Release the placement group ``configure_engine_kwargs`` reserved, if it did."""
    plan = PlacementPlan.from_engine_kwargs(engine_kwargs)
    if plan is not None:
        RankReservation.of(plan).release()
