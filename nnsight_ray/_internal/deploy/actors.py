"""The engine and merge actor classes: thin Ray shells over ``engine.core`` and ``merge.book``.

Each actor's logic lives below it and never calls Ray; here are its loops,
its watches of the others (``cluster.liveness``) and its hand-off of saved
values by reference.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from typing import Any

import ray

from ...errors import EngineDeadError, RequestError
from ..blocks import graphs
from ..cluster.liveness import (ENGINE, MERGE, ActorRecord, DeathWatch, DeploymentRecords, EngineWatch, actor_id,
                                every, rank_records)
from ..cluster.placement import NAMESPACE, PlacementPlan
from ..engine.core import Report
from ..merge.book import MergeBook, request_summary, trace_saves
from ..observe import metrics
from ..observe.progress import Progress
from ..observe.timeline import FETCH, HANDED, MERGED, Timeline, watch_gc, with_gc
from .records import CLUSTER, DeploymentSpec, forwarded_env, merge_index

logger = logging.getLogger(__name__)

# A group whose requests all finished but whose caller never asked for it
# (the caller died right after submitting) is dropped after this long.
ABANDON_AFTER_S = float(os.environ.get("NNSIGHT_RAY_ABANDON_AFTER_S", "30"))
GROUP_TTL_S = float(os.environ.get("NNSIGHT_RAY_GROUP_TTL_S", "3600"))
# How often the engine actor looks at its ranks and merge actors, and each merge
# actor at the engine actor; a ping unanswered this long is logged, not a death.
WATCH_PERIOD_S = 1.0
PING_TIMEOUT_S = 10.0
# How long a merge actor that saw a rank fail waits for the engine actor to declare the death.
DECLARED_WAIT_S = 7.0  # the engine holds a kill-only death back up to DeathWatch.KILL_GRACE_S (3 s)


def _import_rank_class() -> None:
    try:
        from ..ranks import executor  # noqa: F401
    except Exception:  # only a warm-up: set_ranks reports a real problem
        logger.debug("could not import the rank actor class", exc_info=True)


class MergeActor:
    """Takes each finished request's payloads from every rank, merges, resolves callers.

    A shell over ``merge.book.MergeBook`` (groups, waiting, expiry) and
    ``liveness.EngineWatch`` (it watches the engine actor, so a caller waiting
    here learns of the engine actor's death within seconds).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.ranks: list[Any] = []
        self.rank_names: list[str] = []
        self.book = MergeBook(ABANDON_AFTER_S, GROUP_TTL_S)
        self.watch = EngineWatch(name, self.book, CLUSTER, (ray.exceptions.RayActorError,),
                                 ping_timeout_s=PING_TIMEOUT_S, declared_wait_s=DECLARED_WAIT_S)
        self._sweeper: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._heap_frozen = False
        # Fetches, merges and hand-backs (``timeline``).
        self.events = Timeline()
        watch_gc()
        # A handle on a rank actor (set_ranks) loads the rank's class, whose
        # module imports vLLM: ~7 s on the engine's start-up path if left until
        # then. Import it now, while the engine actor is still starting vLLM.
        self._prewarm = threading.Thread(target=_import_rank_class, name="nnsight-ray-prewarm", daemon=True)
        self._prewarm.start()

    async def set_ranks(self, ranks: list[ActorRecord], engine: Any = None,
                        engine_record: ActorRecord | None = None) -> None:
        """Rank actors in rank order (rank = pp * tp_size + tp): the merge order; and the engine to watch."""
        self.ranks = [ray.get_actor(r.name, namespace=NAMESPACE) for r in ranks]
        self.rank_names = [r.name for r in ranks]
        if not self._heap_frozen:
            # As the engine actor does once its engine is up (vLLM's freeze_gc_heap): the startup heap
            # (torch, vLLM, Ray, nnsight) goes to a frozen generation no collection scans again. Without
            # it one full collection here held a 2,048-prompt result for 403 ms (H200). Once
            # per actor, whatever froze before: on the H200 something in the process froze 375 objects
            # first, a guard on gc.get_freeze_count() skipped this, and a full collection of the 770k
            # unfrozen objects held the third run of every engine's first workload for 0.4-0.7 s.
            self._heap_frozen = True
            await asyncio.to_thread(self._prewarm.join, 60)
            from vllm.utils.gc_utils import freeze_gc_heap

            freeze_gc_heap()
        self.watch.watch(ranks, engine_record)
        if engine is not None and self._watcher is None:
            self._watcher = asyncio.ensure_future(every(
                WATCH_PERIOD_S, lambda: self.watch.engine_gone(engine.ready.remote), f"{self.name} engine watch"))

    async def fail(self, message: str) -> None:
        """The deployment is dead: every waiter here, and every later wait, fails with ``message``."""
        self.watch.fail(message)

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(every(ABANDON_AFTER_S / 3, self._sweep, f"{self.name} sweep"))

    async def _sweep(self) -> bool:
        self.book.sweep()
        return False

    async def finish(self, reports: list[Report]) -> None:
        """Merge a batch of finished requests: one ``take_payloads`` per rank for all of them."""
        self._ensure_sweeper()
        began = time.monotonic()
        # Only collected requests left payloads on the ranks (engine.Report.collected).
        positions = [i for i, r in enumerate(reports) if r.collected]
        per_rank: list[list[bytes | None]] = [[None] * len(reports) for _ in self.ranks]
        failure = None
        if positions:
            request_ids = [reports[i].request_id for i in positions]
            taken = await asyncio.gather(*(r.take_payloads.remote(request_ids) for r in self.ranks),
                                         return_exceptions=True)
            for name, result in zip(self.rank_names, taken):
                if isinstance(result, BaseException) and failure is None:  # a rank died between collect and take
                    failure = EngineDeadError(await self.watch.death_message(
                        f"rank actor {name} could not hand over its saves ({type(result).__name__}: {result})"))
            if failure is None:
                for row, payloads in zip(per_rank, taken):
                    for position, payload in zip(positions, payloads):
                        row[position] = payload
            self.events.mark(FETCH, len(positions), began)
        fetched = time.monotonic()
        self.book.arrive(reports, per_rank, failure)
        self.events.mark(MERGED, len(reports), fetched)
        metrics.observe("nnsight_collect_seconds", time.monotonic() - began, stage="merge")

    async def outputs(self, group: str, size: int) -> list[Any]:
        """The group's ``RequestOutput``s, saves attached (raises the group's error)."""
        self._ensure_sweeper()
        state = await self.book.wait(group, size)
        self.events.mark(HANDED, size)
        if state.error is not None:
            raise state.error
        from ..merge.payload import Packed  # Ray writes the saves with the fast tensor path

        return Packed(state.ordered())

    async def trace(self, group: str, size: int, presaved: set[str], outputs: bool = False) -> Any:
        """A non-blocking trace's ``{name: value}``; raises its intervention's error, typed.

        Raised here, the error reaches whoever ``ray.get``s the ref (the caller,
        or any task it was passed to) as Ray's task error, which is an instance
        of the intervention's exception type (``except ValueError`` works).
        ``outputs``: ``({name: value}, [each invoke's request_summary])``.
        """
        self._ensure_sweeper()
        state = await self.book.wait(group, size)
        self.events.mark(HANDED, size)
        if state.error is not None:
            raise state.error
        from ..merge.payload import Packed

        saves = trace_saves(state.ordered(), presaved)
        if outputs:
            return Packed((saves, [request_summary(output) for output in state.ordered()]))
        return Packed(saves)

    async def stats(self) -> dict[str, Any]:
        # gc_unfrozen: what a full collection here scans (a frozen startup heap leaves thousands, not 770k).
        return {**self.book.stats(), "gc_frozen": gc.get_freeze_count(), "gc_unfrozen": len(gc.get_objects())}

    async def timeline(self, since: float = 0.0) -> list[tuple]:
        """Fetches, merges and hand-backs from ``since`` (``time.monotonic``) on (``timeline``)."""
        return with_gc(self.events.since(since), since)


class EngineActor:
    """The driver actor: vLLM's AsyncLLM on nnsight_ray's Ray rank executor.

    A shell: ``engine.core.EngineCore`` runs the engine, ``engine.core.engine_args``
    decides its start-up, and ``liveness.DeathWatch`` watches every actor of
    the deployment and vLLM's engine-core process; this class wires Ray to them.
    """

    def __init__(self, spec: DeploymentSpec) -> None:
        self.spec = spec
        self.core = None
        self.watch: DeathWatch | None = None
        self.records: DeploymentRecords | None = None
        self.topology: list[dict[str, Any]] = []
        self.merges: list[Any] = []
        self.started = time.monotonic()
        self.resolved: dict[str, str] = {}
        self.early_ranks: list[Any] = []  # rank actors this actor created (RankPlacement.early_ranks)
        self.start_line = ""

    async def start(self) -> list[dict[str, Any]]:
        # vLLM's batch limits depend on the ranks' device, which this actor
        # (no GPU of its own) cannot see: a rank's bundle answers, while this
        # process imports vLLM (parity.py).
        probe = probe_rank_platform(self.spec.placement)
        from nnsight.modeling.vllm.vllm import VLLM
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from ..engine import parity
        from ..engine.core import EngineCore, engine_args
        from ..ranks.executor import early_ranks, start_ranks_early

        VLLM._require_v1_model_runner()
        spec = self.spec
        began = time.monotonic()
        probed = await probe if probe is not None else None
        kwargs, changed = engine_args(spec)
        # Read by vLLM in this process and inherited by the engine core and the ranks (vLLM forwards it).
        os.environ.update(graphs.engine_env(kwargs))
        # The rank placement group is deploy's (launch reserved it): if this
        # fails, wait_started releases it, and nothing here does.
        args = parity.build_engine_args(kwargs, probed)
        usage = UsageContext(parity.usage_context(spec.usage_context))
        vllm_config = args.create_engine_config(usage)
        # early_ranks: the ranks' processes import vLLM while the engine core's does.
        early = self.early_ranks = start_ranks_early(vllm_config) if early_ranks(vllm_config) else []
        try:
            # The engine's step clock: vLLM's per-step stat-logger callback, where its stats are on anyway.
            progress = Progress(ticking=not args.disable_log_stats)
            llm = AsyncLLM.from_vllm_config(vllm_config, usage_context=usage, enable_log_requests=args.enable_log_requests,
                                            disable_log_stats=args.disable_log_stats,
                                            stat_loggers=progress.stat_loggers())
        except BaseException:
            for actor in early:  # adopted or not, nothing of them outlives a failed start
                ray.kill(actor)
            raise
        self.start_line = parity.log_start(spec.name, spec.usage_context, changed, llm.vllm_config, probed)
        self.resolved = parity.config_summary(llm.vllm_config)
        vllm_up = time.monotonic()
        self.merges = [ray.get_actor(n, namespace=NAMESPACE) for n in spec.merge_names]
        self.core = EngineCore(llm, self._notify, self._describe_dead, on_dead=self._tell_merges, progress=progress)
        self.topology = await llm.collective_rpc("nnsight_ray_describe")
        described = time.monotonic()
        context = ray.get_runtime_context()
        self.records = DeploymentRecords(
            engine=ActorRecord(ENGINE, spec.engine_name, context.get_actor_id(), context.get_node_id(), os.getpid()),
            merges=[ActorRecord(MERGE, n, actor_id(m)) for n, m in zip(spec.merge_names, self.merges)],
            ranks=rank_records(self.topology))
        self.watch = DeathWatch(self.records, CLUSTER, self.core.core_processes)
        me = context.current_actor
        await asyncio.gather(*(m.set_ranks.remote(self.records.ranks, me, self.records.engine) for m in self.merges))
        logger.info("engine %s: imports %.1f s, vLLM engine %.1f s, describe %.1f s, merges %.1f s",
                    spec.name, began - self.started, vllm_up - began, described - vllm_up,
                    time.monotonic() - described)
        self._watcher = asyncio.ensure_future(
            every(WATCH_PERIOD_S, lambda: self.watch.check(self.core), f"engine {spec.name} watch"))
        # What vLLM's own API server does once its engine is up: the startup heap (torch, vLLM,
        # Ray, the tokenizer) moves to a frozen generation the collector never scans again. Without
        # it, one full collection in this process paused a 2,048-prompt submit for 0.5 s (H200).
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        logger.info("engine %s ready: %d ranks", spec.name, len(self.records.ranks))
        return self.topology

    def _notify(self, reports: list[Report]) -> None:
        shards: dict[int, list[Report]] = {}
        for report in reports:
            shards.setdefault(merge_index(report.group, len(self.merges)), []).append(report)
        for shard, batch in shards.items():
            self.merges[shard].finish.remote(batch)

    def _tell_merges(self, error: EngineDeadError) -> None:
        """Every merge actor fails its waiters (and later waits) with the engine's death message."""
        metrics.inc("nnsight_engine_deaths", deployment=self.spec.name)
        for merge in self.merges:
            merge.fail.remote(str(error))
        # Ranks this actor started (early_ranks) are its own, not the engine core's: they would outlive a
        # dead core (and hold their device) until the deployment shuts down. vLLM's are killed with its core.
        for rank in self.early_ranks:
            ray.kill(rank)

    async def _describe_dead(self) -> str:
        # Raises until start() built the watch; EngineCore then says it could not tell what died.
        return await self.watch.describe_dead()

    def _require_core(self):
        if self.core is None:
            raise RequestError(f"engine {self.spec.name} is still starting; retry when ready()")
        return self.core

    async def submit(self, group: str, prompts: list, params: list, loras: list | None = None) -> None:
        """Start a group's requests. Never raises: a refusal reaches the caller
        through the merge actor, so callers need not wait for this call."""
        try:
            self._require_core().submit(group, prompts, params, loras)
        except Exception as error:
            self._notify([Report(group, index, f"{group}-{index}", None, error) for index in range(len(prompts))])

    async def stream(self, group: str, prompt: Any, param: Any, lora: Any = None):
        async for output in self._require_core().stream(group, prompt, param, lora):
            yield output

    async def rpc(self, method: str, args: tuple = ()) -> list:
        return await self._require_core().rpc(method, tuple(args))

    async def ready(self) -> bool:
        return self.core is not None and self.core.dead is None

    async def resolved_config(self) -> dict[str, Any]:
        """The engine's resolved vLLM config (``parity.config_summary``) and its start-up log line."""
        self._require_core()
        return {"config": self.resolved, "log": self.start_line}

    async def config(self) -> DeploymentSpec:
        return self.spec

    async def timeline(self, since: float = 0.0) -> dict[str, list]:
        """This actor's submits, adds and ends, and each rank's steps, from ``since`` on (``timeline``)."""
        core = self._require_core()
        ranks = await core.rpc("nnsight_ray_step_timeline", (since,))
        merges = await asyncio.gather(*(merge.timeline.remote(since) for merge in self.merges))
        return {"engine": with_gc(core.timeline.since(since), since), "ranks": ranks,
                "merges": sorted((tuple(e) for events in merges for e in events), key=lambda e: e[0])}

    async def get_topology(self) -> list[dict[str, Any]]:
        return list(self.topology)

    async def get_records(self) -> DeploymentRecords:
        if self.records is None:
            raise RequestError(f"engine {self.spec.name} is still starting; retry when ready()")
        return self.records

    async def health(self) -> dict[str, Any]:
        """Alive only if every actor of the deployment is: the engine, each merge actor, each rank."""
        core = self._require_core()
        # This process's frozen startup heap (``start``), beside the deployment's liveness.
        return {**await self.watch.health(core, time.monotonic() - self.started), "gc_frozen": gc.get_freeze_count()}

    def load(self) -> dict[str, Any]:
        """Requests in flight and seconds without a finished step while they wait (Serve's router reads it)."""
        return self._require_core().load()

    async def shutdown(self) -> None:
        # The executor releases the rank placement group; if vLLM stopped its
        # engine core first, deploy.shutdown releases it afterwards.
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:  # ranks stopping now are not a failure to report
            watcher.cancel()
        if self.core is not None:
            self.core.llm.shutdown()


def probe_rank_platform(plan: PlacementPlan) -> Any:
    """A ref to ``parity.probe_batch_defaults`` run in the first rank's bundle; None for CPU ranks.

    CPU ranks run the engine actor's own platform (the CPU build), which
    resolves the same tables itself. The task asks for the bundle's GPU, so it
    sees the device a rank will, and ends before the ranks are created.
    """
    placement = plan.placement
    if placement.device != "gpu":
        return None
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ..engine import parity
    from ..cluster.placement import placement_group_by_id

    resources = {} if placement.gpu_resource == "GPU" else {placement.gpu_resource: placement.gpus_per_rank}
    task = ray.remote(parity.probe_batch_defaults).options(
        num_cpus=0, num_gpus=placement.gpus_per_rank if placement.gpu_resource == "GPU" else 0,
        resources=resources, runtime_env={"env_vars": forwarded_env()},
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group_by_id(plan.placement_group_id), placement_group_bundle_index=0))
    return task.remote(plan.world_size)
