"""One Ray actor per tensor/pipeline-parallel rank, on CPU and GPU clusters.

vLLM 0.32's ``RayExecutorV2`` already runs ranks as Ray actors over vLLM's
message-queue control plane (shared memory on the driver's node, TCP across
nodes) and a torch.distributed data plane. Four things keep it from serving
this project: ``initialize_ray_cluster`` and ``RayWorkerProc`` refuse the CPU
platform ("current platform cpu does not support ray": it has no
``ray_device_key``); it reserves its own placement group (by GPU only); it
orders ranks by node (driver's node first), not by the bundles the user's
strategy placed; and its actor class and actor names are fixed inside
``_init_executor``.

``NNsightRayExecutor`` subclasses it and keeps vLLM's start-up steps:

* **Through vLLM's hooks** (no copy): ``_build_runtime_env`` (vLLM's, plus a CPU
  rank's OpenMP thread count) and ``_get_actor_resource_kwargs`` (a rank's
  device from the user's placement instead of ``VLLM_RAY_PER_WORKER_GPUS``).
* **The rest of** ``RayExecutorV2._init_executor`` has no seam for the actor
  class, the names or the bundle order, so ``_init_executor`` follows its nine
  steps, numbered as vLLM numbers them, with only these differences:

  1. *Placement.* The group was reserved (or the caller's checked) by
     ``placement.plan_placement`` in the launching process; the executor joins
     the cluster and takes it. ``initialize_ray_cluster`` is not called.
  2. *Bundles.* Rank ``r = pp * tp_size + tp`` goes to bundle ``r``, or to
     ``VLLM_RAY_BUNDLE_INDICES[r]`` when that is set (as in vLLM).
  4. *Ranks.* ``NNsightRankProc`` (CPU-capable, with ``take_payloads`` for the
     merge actors on a second thread: ``max_concurrency``), named
     ``<engine>.pp<p>.tp<t>`` in the ``nnsight_ray`` namespace. With
     ``RankPlacement.early_ranks`` (the default) the engine actor has already created them,
     bare (``start_ranks_early``), with the options this step computes
     (``rank_actor_options``); this step adopts each one that was created so.
  5. *Threads (CPU).* vLLM binds a CPU rank's OpenMP threads through
     environment variables set before its process starts; a Ray actor's
     process already exists, so each rank pins its own affinity. Ranks are
     grouped by host IP (not node id: several raylets on one machine share
     its cores) and each host's cores are split among them.

  vLLM's other steps are kept as they are: the driver's environment
  (``driver_env_vars``), the tensor-transport opt-in for the ``sharded_rdt``
  weight-transfer backend, each rank's GPU ids from Ray and the executor-side
  ``assigned_physical_gpu_ids`` on one node. ``tests/unit/test_executor_pin.py``
  pins the hash of the parent's method: a vLLM upgrade that changes it fails
  there and names the method to re-read.

Everything after start-up (busy loops, ``collective_rpc``, the death monitor,
shutdown) is vLLM's own code path.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from typing import Any

import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from vllm import envs
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.platforms import current_platform
from vllm.v1.executor.multiproc_executor import FutureWrapper
from vllm.v1.executor.ray_env_utils import get_driver_env_vars
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2, RayWorkerHandle, RayWorkerProc
from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

from ..cluster.placement import (ADDITIONAL_CONFIG_KEY, NAMESPACE, PlacementPlan, RankPlacement, RankReservation,
    existing_placement_group, plan_placement, split_ray_options, world_size)
from ..cluster.topology import RankId, cpu_binding_plan

logger = logging.getLogger(__name__)


class NNsightRankProc(RayWorkerProc):
    """vLLM's Ray worker process, able to run on CPU-only nodes.

    Created with vLLM's arguments by the executor, or bare (no arguments) by
    the engine actor before vLLM's engine core exists (``start_ranks_early``),
    and then given them by the executor (``adopt``): vLLM's own ``__init__``
    only stores them, so a bare rank's process imports torch and vLLM while
    the engine core's process does the same.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            super().__init__(*args, **kwargs)

    def adopt(self, expected: dict[str, Any], **init_kwargs: Any) -> bool:
        """Take vLLM's constructor arguments if this actor was created as the executor would create it.

        ``expected`` is what the executor would have given it (``actor_check``);
        on any difference nothing is taken and False is returned (the executor
        then kills this actor and creates the rank itself).
        """
        if actor_check(ray.get_runtime_context()) != expected:
            return False
        RayWorkerProc.__init__(self, **init_kwargs)
        return True

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

    def take_payloads(self, request_ids: list[str]) -> list[Any]:
        """Hand the merge actor what ``nnsight_ray_stash`` kept for these requests.

        Runs on a second actor thread (the rank is created with
        ``max_concurrency`` > 1) while ``run`` owns the first with vLLM's busy loop.
        """
        from .rpcs import take_serialized

        return take_serialized(request_ids)

    def extract_commit(self, part: str, timeout: float = 600.0, fsync: bool = False) -> dict[str, Any] | None:
        """Write extraction part ``part`` once every capture before this call is filed (``extract.capture.commit``)."""
        from ..extract.capture import commit

        return commit(part, timeout, fsync)

    def extract_discard(self, part: str) -> None:
        """Drop what was captured for ``part`` (its requests failed; the driver resubmits them)."""
        from ..extract.capture import discard

        discard(part)

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

    The placement is planned here (``placement.plan_placement``: the ranks'
    placement group reserved unless the caller gave one); release it with
    ``placement.release_placement_group`` if the engine then fails to start.
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


def actor_resources(placement: RankPlacement) -> dict[str, Any]:
    """A rank actor's device request inside its bundle (its CPUs stay with the bundle: ``num_cpus=0``).

    vLLM's ``_get_actor_resource_kwargs`` asks for ``VLLM_RAY_PER_WORKER_GPUS``
    of the platform's ``ray_device_key``; here the amount and resource name
    are the user's (``gpus_per_rank``, ``gpu_resource``), and a CPU rank asks
    for no device.
    """
    if placement.device != "gpu":
        return {"num_gpus": 0}
    if placement.gpu_resource == "GPU":
        return {"num_gpus": placement.gpus_per_rank}
    return {"num_gpus": 0, "resources": {placement.gpu_resource: placement.gpus_per_rank}}


def rank_bundles(world_size: int, bundle_indices: str | None, bundle_nodes: dict[int, str]) -> list[tuple[int, str]]:
    """Each rank's ``(bundle index, node id)``: bundle ``rank``, or ``VLLM_RAY_BUNDLE_INDICES[rank]``.

    vLLM sorts bundles driver-node first; the ranks here keep the bundles'
    order, which the user's strategy (or own group) decided, so a rank's name
    and its bundle never depend on where the driver runs.
    ``bundle_indices`` is vLLM's ``VLLM_RAY_BUNDLE_INDICES`` (comma-separated,
    one distinct index per rank, as vLLM requires).
    """
    if not bundle_indices:
        return [(rank, bundle_nodes[rank]) for rank in range(world_size)]
    try:
        indices = [int(i) for i in bundle_indices.split(",")]
    except ValueError:
        raise ValueError(f"VLLM_RAY_BUNDLE_INDICES={bundle_indices!r}: expected comma-separated integers") from None
    if len(indices) != world_size or len(set(indices)) != len(indices):
        raise ValueError(f"VLLM_RAY_BUNDLE_INDICES={bundle_indices!r}: needs {world_size} distinct bundle indices, "
                         "one per rank (tensor_parallel_size x pipeline_parallel_size)")
    missing = [i for i in indices if i not in bundle_nodes]
    if missing:
        raise ValueError(f"VLLM_RAY_BUNDLE_INDICES={bundle_indices!r}: the placement group has no bundle {missing} "
                         f"(it has {len(bundle_nodes)})")
    return [(index, bundle_nodes[index]) for index in indices]


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


def tensor_transport_options(vllm_config: Any) -> dict[str, Any]:
    """vLLM's step 4 opt-in: the ``sharded_rdt`` weight-transfer backend needs Ray's tensor transport on each rank."""
    transfer = getattr(vllm_config, "weight_transfer_config", None)
    if transfer is None or transfer.backend != "sharded_rdt":
        return {}
    from vllm.distributed.weight_transfer.sharded_rdt_common import check_ray_rdt_version

    check_ray_rdt_version()
    return {"enable_tensor_transport": True}


def rank_runtime_env(vllm_config: Any) -> dict:
    """The rank actors' runtime env: vLLM's (``RayExecutorV2._build_runtime_env``: the engine's
    ``ray_runtime_env``, the platform's no-set-device variables, ...) plus a CPU rank's OpenMP thread
    count (fixed at process start). One function for the executor and ``start_ranks_early``."""
    from types import SimpleNamespace

    runtime_env = RayExecutorV2._build_runtime_env(SimpleNamespace(parallel_config=vllm_config.parallel_config))
    placement = plan_of(vllm_config).placement
    if placement.device == "cpu":
        runtime_env.setdefault("env_vars", {})["OMP_NUM_THREADS"] = str(max(1, int(placement.cpus_per_rank)))
    return runtime_env


def plan_of(vllm_config: Any) -> PlacementPlan:
    plan = PlacementPlan.from_engine_kwargs({"additional_config": vllm_config.additional_config})
    if plan is None:
        raise RuntimeError("NNsightRayExecutor runs only through nnsight_ray (LocalVLLM with "
                           "distributed_executor_backend='ray', or RayVLLM), which plans its placement")
    return plan


def rank_actor_options(vllm_config: Any, pg: Any, bundle: int, rank_id: RankId, runtime_env: dict,
                       resources: dict[str, Any]) -> dict[str, Any]:
    """``.options()`` of one rank actor (vLLM's step 4): its name, its bundle, its device ``resources``
    (``actor_resources``) and ``runtime_env`` (``rank_runtime_env``), as vLLM's hooks return them."""
    return dict(
        name=rank_id.actor_name,
        namespace=NAMESPACE,
        num_cpus=0,
        **resources,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle),
        runtime_env=runtime_env,
        # One thread for vLLM's busy loop (`run`), others for the
        # merge actors' `take_payloads` (one per merge shard at a time).
        max_concurrency=8,
        **tensor_transport_options(vllm_config),
    )


def actor_check(context: Any) -> dict[str, Any]:
    """What a rank actor can tell of how it was created (its runtime env's variables, its placement group,
    the resources it holds), to compare with what the executor would give it (``expected_check``)."""
    env = (context.runtime_env or {}).get("env_vars") or {}
    resources: dict[str, float] = {}
    for key, amount in context.get_assigned_resources().items():
        if key.startswith("bundle"):
            continue
        base = key.split("_group_")[0]  # a placement group's "GPU_group_<i>_<id>" is the rank's "GPU"
        resources[base] = max(resources.get(base, 0), amount)
    return {"env_vars": dict(env), "placement_group": context.get_placement_group_id(), "resources": resources}


def expected_check(options: dict[str, Any]) -> dict[str, Any]:
    """``actor_check`` of an actor created with ``options``, as far as ``options`` decide it."""
    strategy = options["scheduling_strategy"]
    resources = dict(options.get("resources") or {})
    if options.get("num_gpus"):
        resources["GPU"] = options["num_gpus"]
    return {"env_vars": dict((options.get("runtime_env") or {}).get("env_vars") or {}),
            "placement_group": strategy.placement_group.id.hex(), "resources": resources}


def engine_name(vllm_config: Any) -> str:
    """The prefix of the engine's rank actors' names: the user's ``engine_name``, else vLLM's instance id."""
    return plan_of(vllm_config).placement.engine_name or f"engine-{vllm_config.instance_id}"


def engine_ranks(vllm_config: Any) -> tuple[Any, list[tuple[RankId, int, str]]]:
    """The ranks' placement group, and each rank's ``(RankId, bundle index, node id)`` (vLLM's steps 1-2)."""
    plan = plan_of(vllm_config)
    placement = plan.placement
    parallel = vllm_config.parallel_config
    tp_size, size = parallel.tensor_parallel_size, parallel.world_size
    engine = engine_name(vllm_config)
    pg = existing_placement_group(plan.placement_group_id, size, placement.placement_timeout_s)
    bundles = rank_bundles(size, envs.VLLM_RAY_BUNDLE_INDICES, placement_group_table(pg)["bundles_to_node_id"])
    return pg, [(RankId(engine=engine, pp=rank // tp_size, tp=rank % tp_size), bundle, node)
                for rank, (bundle, node) in enumerate(bundles)]


def early_ranks(vllm_config: Any) -> bool:
    """Whether ``vllm_config``'s engine runs its ranks here and asked for them early (``RankPlacement.early_ranks``)."""
    if vllm_config.parallel_config.distributed_executor_backend is not NNsightRayExecutor:
        return False
    return plan_of(vllm_config).placement.early_ranks


def start_ranks_early(vllm_config: Any) -> list[Any]:
    """Create the engine's rank actors bare, before vLLM's engine core starts (``RankPlacement.early_ranks``).

    Each imports torch and vLLM while the engine core's process does; the
    executor adopts them by name (``NNsightRankProc.adopt``) if they are what
    it would have created, else replaces them. The caller kills the returned
    handles if the engine fails to start (killing an adopted one is what
    vLLM's shutdown does anyway).
    """
    pg, ranks = engine_ranks(vllm_config)
    runtime_env, resources = rank_runtime_env(vllm_config), actor_resources(plan_of(vllm_config).placement)
    return [ray.remote(NNsightRankProc).options(
                **rank_actor_options(vllm_config, pg, bundle, rank_id, runtime_env, resources)).remote()
            for rank_id, bundle, _ in ranks]


def _adopted(actor: Any, expected: dict[str, Any], init_kwargs: dict[str, Any]) -> bool:
    try:
        return ray.get(actor.adopt.remote(expected, **init_kwargs))
    except ray.exceptions.RayError:  # it died meanwhile: the executor creates the rank itself
        return False


def _early_rank(name: str) -> Any:
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


class NNsightRayExecutor(RayExecutorV2):
    """vLLM's Ray executor with placement, naming and CPU support of our own (module docstring)."""

    uses_ray: bool = True
    supports_pp: bool = True

    def _plan(self) -> PlacementPlan:
        return plan_of(self.vllm_config)

    def _build_runtime_env(self) -> dict:
        """vLLM's rank runtime env, plus a CPU rank's OpenMP thread count (``rank_runtime_env``)."""
        return rank_runtime_env(self.vllm_config)

    def _get_actor_resource_kwargs(self) -> dict[str, Any]:  # vLLM's is a staticmethod; called on self
        return actor_resources(self._plan().placement)

    def _init_executor(self) -> None:
        """``RayExecutorV2._init_executor``'s steps with our placement, rank class and names (module docstring)."""
        self._finalizer = weakref.finalize(self, self.shutdown)
        self.is_failed = False
        self.failure_callback = None
        self.shutting_down = False
        self.shutdown_lock = threading.Lock()
        self._reservation: RankReservation | None = None

        # Step 1: the cluster and the placement group (planned at launch).
        plan = self._plan()
        placement = plan.placement
        _connect(placement)
        tp_size, pp_size, pcp_size = self._get_parallel_sizes()
        if pcp_size != 1:
            raise NotImplementedError("nnsight_ray's Ray executor does not support prefill context parallelism")
        engine = engine_name(self.vllm_config)
        # Step 2: each rank's bundle (and name).
        pg, ranks = engine_ranks(self.vllm_config)
        self._reservation = RankReservation.of(plan)  # released at shutdown, if the launch reserved it
        self.parallel_config.placement_group = pg
        driver_node = ray.get_runtime_context().get_node_id()

        # Step 3: the broadcast queue (shared memory for ranks on the driver's node, TCP for the rest).
        self.rpc_broadcast_mq = MessageQueue(
            self.world_size,
            sum(1 for _, _, node in ranks if node == driver_node),
            max_chunk_bytes=envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * 1024 * 1024,
            connect_ip=ray.util.get_node_ip_address(),
        )
        handle = self.rpc_broadcast_mq.export_handle()

        # Step 4: one rank actor per bundle (initialized in step 6, once its GPU ids are known): the one the
        # engine actor started early under the rank's name if it is what this step would create, else a new one.
        self.driver_env_vars = get_driver_env_vars(worker_specific_vars=WORKER_SPECIFIC_ENV_VARS)
        runtime_env = self._build_runtime_env()
        resources = self._get_actor_resource_kwargs()
        self.ray_worker_handles = []
        self.rank_ids: list[RankId] = []
        for rank, (rank_id, bundle, node) in enumerate(ranks):
            options = rank_actor_options(self.vllm_config, pg, bundle, rank_id, runtime_env, resources)
            init_kwargs = dict(vllm_config=self.vllm_config, rank=rank, input_shm_handle=handle,
                               is_driver_worker=self._is_driver_worker(rank), is_driver_node=node == driver_node)
            actor = _early_rank(rank_id.actor_name) if placement.early_ranks else None
            if actor is not None and not _adopted(actor, expected_check(options), init_kwargs):
                logger.warning("engine %s: the early rank actor %s is not what vLLM's executor creates (or is "
                               "gone); replacing it", engine, rank_id.actor_name)
                ray.kill(actor)
                actor = None
            if actor is None:
                actor = ray.remote(NNsightRankProc).options(**options).remote(**init_kwargs)
            self.rank_ids.append(rank_id)
            self.ray_worker_handles.append(
                RayWorkerHandle(actor=actor, rank=rank, local_rank=-1, node_id=node, bundle_id_idx=bundle)
            )

        # Step 5: where Ray put each rank (its GPU ids), and, on CPU, its cores.
        actors = [h.actor for h in self.ray_worker_handles]
        placed = ray.get([a.get_node_and_physical_gpu_ids.remote() for a in actors])
        if placement.device == "cpu":
            hosts = ray.get([a.host_info.remote() for a in actors])
            binding = cpu_binding_plan(hosts, placement.cpu_binding)
            ray.get([a.bind_cpus.remote(cpus) for a, cpus in zip(actors, binding) if cpus])

        # Step 6: initialize each rank with its local rank and its node's GPU ids.
        init_method = ray.get(actors[0].create_dist_init_method.remote())
        refs = []
        devices = rank_devices(placed)
        for rank, (local_rank, gpu_ids) in enumerate(devices):
            self.ray_worker_handles[rank].local_rank = local_rank
            refs.append(actors[rank].initialize_worker.remote(
                local_rank, {}, init_method, self.driver_env_vars, assigned_physical_gpu_ids=gpu_ids))
        # As vLLM: the executor-side config gets the mapping too when every rank shares one node.
        if len({node for node, _ in placed}) == 1 and devices[0][1] is not None:
            self.vllm_config.parallel_config.assigned_physical_gpu_ids = devices[0][1]
        ray.get(refs)

        # Step 7: each rank's response queue.
        ready = ray.get([a.wait_for_init.remote() for a in actors])
        self.response_mqs = []
        for rank, result in enumerate(ready):
            if result["status"] != RayWorkerProc.READY_STR:
                raise RuntimeError(f"rank {self.rank_ids[rank]} failed to initialize: {result}")
            self.response_mqs.append(MessageQueue.create_from_handle(result["handle"], 0))

        # Steps 8-9: start the busy loops, then the ready barrier (in that order: ranks subscribe in run()).
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
        reservation, self._reservation = getattr(self, "_reservation", None), None
        if reservation is not None:
            reservation.release()
