"""One Ray actor per tensor/pipeline-parallel rank, on CPU and GPU clusters.

vLLM 0.32's ``RayExecutorV2`` already runs ranks as Ray actors over vLLM's
message-queue control plane (shared memory on the driver's node, TCP across
nodes) and a torch.distributed data plane. Three things keep it from serving
this project: ``initialize_ray_cluster`` and ``RayWorkerProc`` refuse the CPU
platform ("current platform cpu does not support ray": it has no
``ray_device_key``), it places ranks by GPU only, and it neither names ranks by
their (pp, tp) coordinates nor lets the user pick the placement strategy.

``NNsightRayExecutor`` subclasses it and replaces only the start-up:

1. *Placement.* One bundle per rank, ``{"CPU": cpus_per_rank}`` on CPU clusters,
   plus ``{device_key: gpus_per_rank}`` on accelerator clusters, with the
   user's strategy (or the user's own placement group). The wait is bounded;
   on timeout the group is removed and the error names what was asked for and
   what the cluster has.
2. *Ranks.* Rank ``r = pp * tp_size + tp`` goes to bundle ``r``; its actor is
   named ``<engine>.pp<p>.tp<t>`` in the ``nnsight_ray`` namespace.
3. *Threads (CPU).* vLLM binds a CPU rank's OpenMP threads through environment
   variables set before its process starts; a Ray actor's process already
   exists, so each rank pins its own affinity and thread count before the
   worker is built. Ranks are grouped by host IP (not node id: several raylets
   on one machine share its cores) and each host's cores are split among them.

Everything after start-up (message queues, busy loops, ``collective_rpc``,
the death monitor, shutdown) is vLLM's own code path.

The placement is decided before vLLM starts (``options.plan_placement``, in
the launching process); `configure_engine_kwargs` puts that plan and this
executor into vLLM's engine kwargs, and the executor only reads the plan.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from vllm import envs
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.platforms import current_platform
from vllm.v1.executor.multiproc_executor import FutureWrapper
from vllm.v1.executor.ray_env_utils import get_driver_env_vars
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2, RayWorkerHandle, RayWorkerProc
from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

from .options import (ADDITIONAL_CONFIG_KEY, NAMESPACE, PlacementPlan, RankPlacement, existing_placement_group,
                      plan_placement, split_ray_options, world_size)
from .topology import RankId, cpu_binding_plan

logger = logging.getLogger(__name__)


class NNsightRankProc(RayWorkerProc):
    """vLLM's Ray worker process, able to run on CPU-only nodes."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        if not current_platform.ray_device_key:
            return ray.get_runtime_context().get_node_id(), []
        return super().get_node_and_physical_gpu_ids()

    def host_info(self) -> dict[str, Any]:
        """Where this actor landed: node id, host IP and the CPUs it may use."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "cpus": sorted(os.sched_getaffinity(0)),
        }

    def take_payloads(self, request_ids: list[str]) -> list[bytes | None]:
        """Hand the merge actor what ``nnsight_ray_stash`` kept for these requests.

        Runs on a second actor thread (the rank is created with
        ``max_concurrency`` > 1) while ``run`` owns the first with vLLM's busy loop.
        """
        from .rank_worker import stash_take

        return stash_take(request_ids)

    def bind_cpus(self, cpus: list[int]) -> None:
        """Pin every thread of this rank's process to ``cpus`` before the worker starts.

        ``sched_setaffinity`` is per thread on Linux, and Ray has already started
        the actor's threads, so each existing thread is pinned; threads made later
        (OpenMP's pool) inherit from their creator. The OpenMP thread count was
        fixed at process start (``OMP_NUM_THREADS`` in the actor's runtime env).
        """
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:  # the thread ended meanwhile
                pass


def configure_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Turn ``distributed_executor_backend="ray"`` plus our options into vLLM engine kwargs.

    The placement is planned here (``options.plan_placement``: the ranks'
    placement group reserved unless the caller gave one); release it with
    ``options.release_placement_group`` if the engine then fails to start.
    """
    engine, ray_options = split_ray_options(kwargs)
    if engine.get("distributed_executor_backend") != "ray":
        if ray_options:
            raise ValueError(
                f"{sorted(ray_options)} only apply with distributed_executor_backend='ray'; "
                "add it, or drop these options."
            )
        return engine
    plan = plan_placement(RankPlacement.from_options(ray_options), world_size(engine))
    return engine_kwargs_with(plan, engine)


def engine_kwargs_with(plan: PlacementPlan, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` running on this executor with ``plan`` (the only placement vLLM carries)."""
    engine = dict(engine_kwargs)
    # The class, not its import path: vLLM reads `supports_pp` off it before it
    # would resolve a path, and refuses pipeline parallelism otherwise.
    engine["distributed_executor_backend"] = NNsightRayExecutor
    engine["additional_config"] = {**(engine.get("additional_config") or {}), ADDITIONAL_CONFIG_KEY: plan.as_config()}
    return engine


def _connect(placement: RankPlacement) -> None:
    if ray.is_initialized():
        return
    address = placement.ray_address or os.environ.get("RAY_ADDRESS") or "auto"
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)


def _actor_resources(placement: RankPlacement) -> dict[str, Any]:
    """A rank actor's own resource request, inside its bundle (CPUs stay with the bundle)."""
    if placement.device != "gpu":
        return {"num_cpus": 0, "num_gpus": 0}
    if placement.gpu_resource == "GPU":
        return {"num_cpus": 0, "num_gpus": placement.gpus_per_rank}
    return {"num_cpus": 0, "num_gpus": 0, "resources": {placement.gpu_resource: placement.gpus_per_rank}}


def rank_devices(placed: list[tuple[str, list[int]]]) -> list[tuple[int, list[int] | None]]:
    """Each rank's ``(local_rank, visible physical GPU ids)`` from where Ray placed it.

    ``placed[rank]`` is ``(node_id, GPU ids Ray gave that rank's actor)``. A
    rank's local rank is its position among the ranks on its node, in rank
    order, as vLLM counts it; every rank on a node sees all of that node's
    GPUs given to this engine (sorted), and vLLM's worker picks device
    ``local_rank`` among them, so two ranks of one node never share a device.
    """
    node_ranks: dict[str, list[int]] = {}
    node_gpus: dict[str, list[int]] = {}
    for rank, (node_id, gpus) in enumerate(placed):
        node_ranks.setdefault(node_id, []).append(rank)
        node_gpus.setdefault(node_id, []).extend(gpus)
    return [(node_ranks[node_id].index(rank), sorted(node_gpus[node_id]) or None)
            for rank, (node_id, _) in enumerate(placed)]


class NNsightRayExecutor(RayExecutorV2):
    """vLLM's Ray executor with placement, naming and CPU support of our own."""

    uses_ray: bool = True
    supports_pp: bool = True

    def _init_executor(self) -> None:
        self._finalizer = weakref.finalize(self, self.shutdown)
        self.is_failed = False
        self.failure_callback = None
        self.shutting_down = False
        self.shutdown_lock = threading.Lock()
        self._owned_pg: PlacementGroup | None = None

        plan = PlacementPlan.from_engine_kwargs({"additional_config": self.vllm_config.additional_config})
        if plan is None:
            raise RuntimeError("NNsightRayExecutor runs only through nnsight_ray (LocalVLLM with "
                               "distributed_executor_backend='ray', or RayVLLM), which plans its placement")
        placement = plan.placement
        _connect(placement)
        tp_size, pp_size, pcp_size = self._get_parallel_sizes()
        if pcp_size != 1:
            raise NotImplementedError("nnsight_ray's Ray executor does not support prefill context parallelism")
        engine = placement.engine_name or f"engine-{self.vllm_config.instance_id}"

        pg = existing_placement_group(plan.placement_group_id, self.world_size, placement.placement_timeout_s)
        if plan.owns_placement_group:
            self._owned_pg = pg
        self.parallel_config.placement_group = pg
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        driver_node = ray.get_runtime_context().get_node_id()
        rank_nodes = [bundle_nodes[rank] for rank in range(self.world_size)]

        self.rpc_broadcast_mq = MessageQueue(
            self.world_size,
            sum(1 for node in rank_nodes if node == driver_node),
            max_chunk_bytes=envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * 1024 * 1024,
            connect_ip=ray.util.get_node_ip_address(),
        )
        handle = self.rpc_broadcast_mq.export_handle()
        runtime_env = self._build_runtime_env()
        if placement.device == "cpu":
            runtime_env.setdefault("env_vars", {})["OMP_NUM_THREADS"] = str(max(1, int(placement.cpus_per_rank)))
        resources = _actor_resources(placement)

        self.ray_worker_handles = []
        self.rank_ids: list[RankId] = []
        for rank in range(self.world_size):
            rank_id = RankId(engine=engine, pp=rank // tp_size, tp=rank % tp_size)
            actor = (
                ray.remote(NNsightRankProc)
                .options(
                    name=rank_id.actor_name,
                    namespace=NAMESPACE,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=rank
                    ),
                    runtime_env=runtime_env,
                    # One thread for vLLM's busy loop (`run`), others for the
                    # merge actors' `take_payloads` (one per merge shard at a time).
                    max_concurrency=4,
                    **resources,
                )
                .remote(
                    vllm_config=self.vllm_config,
                    rank=rank,
                    input_shm_handle=handle,
                    is_driver_worker=self._is_driver_worker(rank),
                    is_driver_node=rank_nodes[rank] == driver_node,
                )
            )
            self.rank_ids.append(rank_id)
            self.ray_worker_handles.append(
                RayWorkerHandle(actor=actor, rank=rank, local_rank=-1, node_id=rank_nodes[rank], bundle_id_idx=rank)
            )

        actors = [h.actor for h in self.ray_worker_handles]
        placed = ray.get([a.get_node_and_physical_gpu_ids.remote() for a in actors])
        hosts = ray.get([a.host_info.remote() for a in actors])
        if placement.device == "cpu":
            plan = cpu_binding_plan(hosts, placement.cpu_binding)
            ray.get([a.bind_cpus.remote(cpus) for a, cpus in zip(actors, plan) if cpus])

        init_method = ray.get(actors[0].create_dist_init_method.remote())
        driver_env = get_driver_env_vars(worker_specific_vars=WORKER_SPECIFIC_ENV_VARS)
        refs = []
        for rank, (local_rank, gpu_ids) in enumerate(rank_devices(placed)):
            self.ray_worker_handles[rank].local_rank = local_rank
            refs.append(
                actors[rank].initialize_worker.remote(
                    local_rank, {}, init_method, driver_env, assigned_physical_gpu_ids=gpu_ids,
                )
            )
        ray.get(refs)

        ready = ray.get([a.wait_for_init.remote() for a in actors])
        self.response_mqs = []
        for rank, result in enumerate(ready):
            if result["status"] != RayWorkerProc.READY_STR:
                raise RuntimeError(f"rank {self.rank_ids[rank]} failed to initialize: {result}")
            self.response_mqs.append(MessageQueue.create_from_handle(result["handle"], 0))
        for h in self.ray_worker_handles:
            h.run()
        self.rpc_broadcast_mq.wait_until_ready()
        for mq in self.response_mqs:
            mq.wait_until_ready()

        self.futures_queue = deque[FutureWrapper]()
        self._post_init_executor()
        self.start_worker_monitor()
        self.output_rank = self._get_output_rank()
        logger.info("engine %s: %d rank actors up (tp=%d, pp=%d)", engine, self.world_size, tp_size, pp_size)

    def shutdown(self) -> None:
        super().shutdown()
        pg, self._owned_pg = getattr(self, "_owned_pg", None), None
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:  # cluster already gone
                logger.debug("could not remove placement group", exc_info=True)

