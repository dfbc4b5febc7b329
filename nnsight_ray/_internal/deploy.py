"""The Ray edge of a deployment: engine and merge actor classes, their options, launch / connect / shutdown.

The engine and merge actors' ``ray.remote`` options (names, namespace,
lifetime, resources, runtime env) are applied here; the rank actors' by the
executor that vLLM's engine core runs (``ray_executor.py``). The logic lives
in ``engine.py`` and ``merge.py`` and never calls Ray itself.

Names, in the ``nnsight_ray`` namespace, for a deployment called ``<name>``::

    <name>.engine          EngineActor (the driver actor: vLLM's AsyncLLM)
    <name>.merge<i>        MergeActor shard i (requests are sharded by group id)
    <name>.pp<p>.tp<t>     rank actors (created by vLLM's engine core through
                           nnsight_ray's Ray executor)
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import zlib
from typing import Any

import ray

from ..errors import EngineDeadError, RequestError
from . import metrics
from .engine import Report
from .liveness import (ENGINE, MERGE, ActorRecord, ActorState, DeploymentRecords, as_dicts, dead_message,
                       diagnose, engine_dead, every, rank_records, read_states)
from .merge import MergeBook, trace_saves
from .ray_errors import cause
from .options import (NAMESPACE, PlacementPlan, RankPlacement, placement_group_name, plan_placement,
                      remove_named_placement_groups, world_size)
from .topology import RankId

logger = logging.getLogger(__name__)

# Environment the engine actor (and the engine-core process and ranks it
# starts) inherits from the deploying process: a raylet's workers otherwise
# see the raylet's environment, not the caller's.
_FORWARDED_ENV_PREFIXES = ("VLLM_", "NNSIGHT", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
# A group whose requests all finished but whose caller never asked for it
# (the caller died right after submitting) is dropped after this long.
ABANDON_AFTER_S = float(os.environ.get("NNSIGHT_RAY_ABANDON_AFTER_S", "30"))
GROUP_TTL_S = float(os.environ.get("NNSIGHT_RAY_GROUP_TTL_S", "3600"))
# How often the engine actor looks at its ranks and merge actors, and each merge
# actor at the engine actor; a ping unanswered this long is logged, not a death.
WATCH_PERIOD_S = 1.0
PING_TIMEOUT_S = 10.0
# How long a merge actor that saw a rank fail waits for the engine actor to declare the death.
DECLARED_WAIT_S = 5.0


# Per-node settings: forwarding them would make a remote node advertise this one's.
_NODE_LOCAL_ENV = {"VLLM_HOST_IP", "VLLM_PORT", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "OMP_PLACES"}


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(_FORWARDED_ENV_PREFIXES) and k not in _NODE_LOCAL_ENV}


def merge_index(group: str, shards: int) -> int:
    """Which merge shard serves a group: stable across processes (not Python's hash)."""
    return zlib.crc32(group.encode()) % shards


def gcs_actor_entry(actor_id: str) -> dict[str, Any] | None:
    """The GCS actor-table entry of one actor (blocking), or None if it has none."""
    import ray._private.state as ray_state

    return ray_state.actors(actor_id=actor_id) or None


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def actor_death_message(record: ActorRecord | None, error: BaseException | None = None) -> str:
    """The engine-dead message for one actor found dead (blocking: reads the GCS)."""
    if record is None:
        return engine_dead(f"an actor of the deployment died ({error})")
    message = dead_message(read_states([record], gcs_actor_entry), alive_nodes())
    return message or engine_dead(f"{record.describe()} died ({type(error).__name__ if error else 'gone'})")


def _import_rank_class() -> None:
    try:
        from . import ray_executor  # noqa: F401
    except Exception:  # only a warm-up: set_ranks reports a real problem
        logger.debug("could not import the rank actor class", exc_info=True)


class MergeActor:
    """Takes each finished request's payloads from every rank, merges, resolves callers.

    A shell over ``merge.MergeBook``; it also watches the engine actor, so a
    caller waiting here learns of the engine actor's death within seconds.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.ranks: list[Any] = []
        self.rank_names: list[str] = []
        self.rank_records: list[ActorRecord] = []
        self.engine_record: ActorRecord | None = None
        self.book = MergeBook(ABANDON_AFTER_S, GROUP_TTL_S)
        self._sweeper: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        # A handle on a rank actor (set_ranks) loads the rank's class, whose
        # module imports vLLM: ~7 s on the engine's start-up path if left until
        # then. Import it now, while the engine actor is still starting vLLM.
        threading.Thread(target=_import_rank_class, name="nnsight-ray-prewarm", daemon=True).start()

    async def set_ranks(self, ranks: list[ActorRecord], engine: Any = None,
                        engine_record: ActorRecord | None = None) -> None:
        """Rank actors in rank order (rank = pp * tp_size + tp): the merge order; and the engine to watch."""
        self.ranks = [ray.get_actor(r.name, namespace=NAMESPACE) for r in ranks]
        self.rank_names = [r.name for r in ranks]
        self.rank_records = list(ranks)
        self.engine_record = engine_record
        if engine is not None and self._watcher is None:
            self._watcher = asyncio.ensure_future(
                every(WATCH_PERIOD_S, lambda: self._engine_gone(engine, engine_record), f"{self.name} engine watch"))

    async def _engine_gone(self, engine: Any, record: ActorRecord | None) -> bool:
        """One look at the engine actor; True (and every waiter failed) once it is dead."""
        if self.book.dead is not None:
            return True
        try:
            await asyncio.wait_for(engine.ready.remote(), PING_TIMEOUT_S)
        except ray.exceptions.RayActorError as error:
            await self.fail(await asyncio.get_running_loop().run_in_executor(None, actor_death_message, record, error))
            return True
        except asyncio.TimeoutError:
            logger.warning("%s: the engine actor did not answer a ping within %.0f s", self.name, PING_TIMEOUT_S)
        return False

    async def fail(self, message: str) -> None:
        """The deployment is dead: every waiter here, and every later wait, fails with ``message``."""
        if self.book.dead is None:
            logger.error("%s: %s", self.name, message)
        self.book.fail(message)

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(every(ABANDON_AFTER_S / 3, self._sweep, f"{self.name} sweep"))

    async def _sweep(self) -> bool:
        self.book.sweep()
        return False

    async def finish(self, reports: list[Report]) -> None:
        """Merge a batch of finished requests: one ``take_payloads`` per rank for all of them."""
        self._ensure_sweeper()
        began = time.perf_counter()
        request_ids = [r.request_id for r in reports]
        per_rank: list[list[bytes | None]] = [[None] * len(reports) for _ in self.ranks]
        failure = None
        taken = await asyncio.gather(*(r.take_payloads.remote(request_ids) for r in self.ranks), return_exceptions=True)
        for name, result in zip(self.rank_names, taken):
            if isinstance(result, BaseException) and failure is None:  # a rank died between collect and take
                failure = EngineDeadError(await self._death_message(
                    f"rank actor {name} could not hand over its saves ({type(result).__name__}: {result})"))
        if failure is None:
            per_rank = list(taken)
        self.book.arrive(reports, per_rank, failure)
        metrics.observe("nnsight_collect_seconds", time.perf_counter() - began, stage="merge")

    async def _death_message(self, what: str) -> str:
        """The deployment's one death message, for a failure seen here first.

        The rank that failed to hand over is often not the one that died (vLLM
        stops the other ranks when one dies), and the engine actor, which
        watches every actor and vLLM's engine-core process, declares the death
        to every merge actor within a second or two (``fail``). So wait for
        that word; if it does not come in time, name the first actor the GCS
        saw die, as the engine would.
        """
        declared = await self.book.death(DECLARED_WAIT_S)
        if declared is not None:
            return declared
        loop = asyncio.get_running_loop()
        records = [*self.rank_records, *([self.engine_record] if self.engine_record else [])]
        states = await loop.run_in_executor(None, lambda: read_states(records, gcs_actor_entry))
        return dead_message(states, await loop.run_in_executor(None, alive_nodes)) or engine_dead(what)

    async def outputs(self, group: str, size: int) -> list[Any]:
        """The group's ``RequestOutput``s, saves attached (raises the group's error)."""
        self._ensure_sweeper()
        state = await self.book.wait(group, size)
        if state.error is not None:
            raise state.error
        from .payload import Packed  # Ray writes the saves with the fast tensor path

        return Packed(state.ordered())

    async def trace(self, group: str, size: int, presaved: set[str]) -> dict[str, Any]:
        """A non-blocking trace's ``{name: value}``; raises its intervention's error, typed.

        Raised here, the error reaches whoever ``ray.get``s the ref (the caller,
        or any task it was passed to) as Ray's task error, which is an instance
        of the intervention's exception type (``except ValueError`` works).
        """
        self._ensure_sweeper()
        state = await self.book.wait(group, size)
        if state.error is not None:
            raise state.error
        from .payload import Packed

        return Packed(trace_saves(state.ordered(), presaved))

    async def stats(self) -> dict[str, Any]:
        return self.book.stats()


class EngineActor:
    """The driver actor: vLLM's AsyncLLM on nnsight_ray's Ray rank executor."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.core = None
        self.topology: list[dict[str, Any]] = []
        self.merges: list[Any] = []
        self.started = time.monotonic()

    async def start(self) -> list[dict[str, Any]]:
        from nnsight.modeling.vllm.vllm import VLLM
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from . import platform
        from .engine import EngineCore
        from .ray_executor import engine_kwargs_with

        VLLM._require_v1_model_runner()
        kwargs = platform.engine_defaults(self.spec["engine_kwargs"])
        # nnsight's engine defaults (VLLM._load): a traced prompt is prefilled in
        # one forward and every token runs a forward pass.
        kwargs.setdefault("enable_chunked_prefill", False)
        kwargs.setdefault("enable_prefix_caching", False)
        kwargs = engine_kwargs_with(PlacementPlan.model_validate(self.spec["placement"]), kwargs)
        began = time.monotonic()
        # The rank placement group is deploy's (launch reserved it): if this
        # fails, wait_started removes it by name, and nothing here does.
        args = AsyncEngineArgs(model=self.spec["model"], worker_cls=platform.worker_cls(), enforce_eager=True, **kwargs)
        llm = AsyncLLM.from_engine_args(args)
        vllm_up = time.monotonic()
        self.merges = [ray.get_actor(n, namespace=NAMESPACE) for n in self.spec["merge_names"]]
        self.core = EngineCore(llm, self._notify, self._describe_dead, on_dead=self._tell_merges)
        self.topology = await llm.collective_rpc("nnsight_ray_describe")
        described = time.monotonic()
        context = ray.get_runtime_context()
        self.records = DeploymentRecords(
            engine=ActorRecord(ENGINE, f"{self.spec['name']}.engine", context.get_actor_id(),
                               context.get_node_id(), os.getpid()),
            merges=[ActorRecord(MERGE, n, m._actor_id.hex()) for n, m in zip(self.spec["merge_names"], self.merges)],
            ranks=rank_records(self.topology))
        names = [r.name for r in self.records.ranks]
        me = context.current_actor
        await asyncio.gather(*(m.set_ranks.remote(self.records.ranks, me, self.records.engine) for m in self.merges))
        logger.info("engine %s: imports %.1f s, vLLM engine %.1f s, describe %.1f s, merges %.1f s",
                    self.spec["name"], began - self.started, vllm_up - began, described - vllm_up,
                    time.monotonic() - described)
        self._watcher = asyncio.ensure_future(every(WATCH_PERIOD_S, self._check, f"engine {self.spec['name']} watch"))
        logger.info("engine %s ready: %d ranks", self.spec["name"], len(names))
        return self.topology

    def _notify(self, reports: list[Report]) -> None:
        shards: dict[int, list[Report]] = {}
        for report in reports:
            shards.setdefault(merge_index(report.group, len(self.merges)), []).append(report)
        for shard, batch in shards.items():
            self.merges[shard].finish.remote(batch)

    def _tell_merges(self, error: EngineDeadError) -> None:
        """Every merge actor fails its waiters (and later waits) with the engine's death message."""
        metrics.inc("nnsight_engine_deaths", deployment=self.spec["name"])
        for merge in self.merges:
            merge.fail.remote(str(error))

    def _survey(self) -> list[ActorState]:
        """Every actor of this deployment as the GCS actor table has it (blocking: run in a thread).

        Read by actor id from the GCS (the data behind ``ray list actors``)
        because it keeps *when* each actor ended: vLLM's executor kills the
        surviving ranks within milliseconds of the first death, and only the
        end times tell which one went first.
        """
        states = read_states(self.records.others(), gcs_actor_entry)
        return [ActorState(self.records.engine, "ALIVE", self.records.engine.node_id), *states]

    async def _check(self) -> bool:
        """One watch step: fail the engine as soon as a rank or merge actor is gone, or vLLM errored.

        vLLM's executor notices a dead rank too, but a core blocked mid-step
        (a collective with the dead peer) may never report it; this does not
        depend on that. True once the engine is dead (the watch ends).
        """
        core = self.core
        if core is None or core.dead is not None:
            return core is not None
        message = await self._diagnose()
        if message is None and getattr(core.llm, "errored", False):
            message = await self._describe_dead()
        if message is not None:
            await core.fail(EngineDeadError(message))
            return True
        return False

    async def _diagnose(self) -> str | None:
        """The death message if vLLM's engine-core process, a rank or a merge actor is gone (``liveness.diagnose``)."""
        loop = asyncio.get_running_loop()
        states = await loop.run_in_executor(None, self._survey)
        return diagnose(states, await loop.run_in_executor(None, alive_nodes), self._core_process())

    def _core_processes(self) -> list[Any]:
        """vLLM's engine-core processes (``multiprocessing`` handles); none before the engine is up."""
        try:
            return list(self.core.llm.engine_core.resources.engine_manager.processes)
        except AttributeError:
            return []

    def _core_process(self) -> str | None:
        """``engine core process pid P exited with code C`` if vLLM's engine-core process has ended."""
        ended = [p for p in self._core_processes() if p.exitcode is not None]
        if not ended:
            return None
        return "; ".join(f"vLLM's engine core process (pid {p.pid}) of {self.records.engine.describe()} "
                         f"exited with code {p.exitcode}" for p in ended)

    async def _describe_dead(self) -> str:
        """What killed the engine, once vLLM said it is dead (the GCS may learn of a death a moment later)."""
        for attempt in range(3):
            message = await self._diagnose()
            if message is not None:
                return message
            await asyncio.sleep(1.0)
        return engine_dead(f"vLLM's engine core in {self.records.engine.describe()} failed with every actor "
                           "alive (see the engine actor's log)")

    def _require_core(self):
        if self.core is None:
            raise RequestError(f"engine {self.spec['name']} is still starting; retry when ready()")
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

    async def config(self) -> dict[str, Any]:
        return dict(self.spec)

    async def get_topology(self) -> list[dict[str, Any]]:
        return list(self.topology)

    async def get_records(self) -> DeploymentRecords:
        return self.records

    async def health(self) -> dict[str, Any]:
        """Alive only if every actor of the deployment is: the engine, each merge actor, each rank."""
        core = self._require_core()
        if core.dead is None:
            await self._check()
        states = await asyncio.get_running_loop().run_in_executor(None, self._survey)
        return {"alive": core.dead is None, "error": None if core.dead is None else str(core.dead),
                "actors": as_dicts(states), "uptime_s": time.monotonic() - self.started,
                "collect": dict(core.collect_stats), "core_pids": [p.pid for p in self._core_processes()]}

    async def shutdown(self) -> None:
        # The executor removes the rank placement group; if vLLM stopped its
        # engine core first, deploy.shutdown removes it by name afterwards.
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:  # ranks stopping now are not a failure to report
            watcher.cancel()
        if self.core is not None:
            self.core.llm.shutdown()


def eager_engine_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` without ``enforce_eager``, which every nnsight_ray engine sets itself.

    As nnsight's ``VLLM`` does for an engine with no taps: every location must
    be served, so the engine runs eagerly. ``enforce_eager=True`` is accepted
    (it is what happens); ``False`` is refused with the reason, instead of
    vLLM's "got multiple values for keyword argument 'enforce_eager'".
    """
    engine_kwargs = dict(engine_kwargs)
    asked = engine_kwargs.pop("enforce_eager", None)
    if asked is not None and not asked:
        raise RequestError(
            "enforce_eager=False: nnsight_ray engines run eagerly, as nnsight's VLLM does without taps, "
            "so every module's hooks fire on every step (a replayed CUDA graph runs no Python). "
            "Drop enforce_eager."
        )
    return engine_kwargs


def launch(name: str, model: str, engine_kwargs: dict[str, Any], placement: RankPlacement,
           num_merge_actors: int = 1, detached: bool = False,
           engine_actor_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plan the ranks' placement (reserving their group), create the merge and engine actors, start the engine; don't wait.

    Returns the deployment's handles with the pending start; ``wait_started``
    waits for it (and cleans up if it failed). Meanwhile the caller can build
    its client, or launch other deployments: an engine start is mostly
    waiting for processes to come up and import vLLM, so several overlap well.

    ``engine_actor_options`` are extra ``.options()`` for the engine actor, e.g.
    ``{"resources": {"gpu_node": 0.01}}`` to keep vLLM's engine core off a
    CPU-only head node of a GPU cluster (docs/clusters.md).
    """
    placement = placement.model_copy(update={"engine_name": name})
    engine_kwargs = eager_engine_kwargs(engine_kwargs)
    lifetime = "detached" if detached else None
    merge_names = [f"{name}.merge{i}" for i in range(num_merge_actors)]
    for actor_name in [f"{name}.engine", *merge_names]:
        try:
            ray.get_actor(actor_name, namespace=NAMESPACE)
        except ValueError:
            continue
        raise RequestError(
            f"a deployment named {name!r} already runs in namespace {NAMESPACE!r} ({actor_name}); "
            f"attach with RayVLLM.connect({name!r}), shut it down, or pick another name."
        )
    # Reserved here, before any actor starts: an unsatisfiable layout fails in
    # seconds with what the cluster has, not after an engine actor has loaded
    # vLLM. Released at shutdown: by the executor, or by name in shutdown(); a
    # non-detached one also by Ray, with this process. A group of this name
    # with no deployment left (a detached one whose actors were killed) is reclaimed.
    if placement.placement_group_id is None and remove_named_placement_groups(placement_group_name(name)):
        logger.warning("deployment %s: removed a rank placement group its previous deployment left", name)
    plan = plan_placement(placement, world_size(engine_kwargs), detached=detached)
    runtime_env = {"env_vars": forwarded_env()}
    merges = [
        ray.remote(MergeActor).options(name=n, namespace=NAMESPACE, lifetime=lifetime, num_cpus=0,
                                       runtime_env=runtime_env).remote(n)
        for n in merge_names
    ]
    spec = {"name": name, "model": model, "engine_kwargs": engine_kwargs,
            "placement": plan.as_config(), "merge_names": merge_names,
            "detached": detached}
    options = {"num_cpus": 0, "runtime_env": runtime_env, "max_concurrency": 10_000,
               **(engine_actor_options or {})}
    engine = ray.remote(EngineActor).options(
        name=f"{name}.engine", namespace=NAMESPACE, lifetime=lifetime, **options,
    ).remote(spec)
    return {"engine": engine, "merges": merges, "spec": spec, "starting": engine.start.remote()}


def wait_started(handles: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """Wait for a ``launch``ed engine to come up; on failure remove all of it and raise the engine's error."""
    starting = handles.pop("starting", None)
    if starting is None:
        return handles
    try:
        ray.get(starting, timeout=timeout_s)
    except BaseException as error:
        for actor in [handles["engine"], *handles["merges"]]:
            ray.kill(actor)
        if PlacementPlan.model_validate(handles["spec"]["placement"]).owns_placement_group:
            remove_named_placement_groups(placement_group_name(handles["spec"]["name"]))
        if isinstance(error, ray.exceptions.RayTaskError):
            raise cause(error) from None
        raise
    return handles


def discard(handles: dict[str, Any]) -> None:
    """Take down a ``launch``ed deployment that will not be used (its start may still be under way)."""
    if "starting" not in handles:
        shutdown(handles)
        return
    try:
        wait_started(handles)  # a half-started engine cannot be stopped cleanly
    except Exception:
        return  # its start failed, and wait_started removed what it had
    shutdown(handles)


def connect(name: str) -> dict[str, Any]:
    """Handles of a running named deployment, from any process in the cluster."""
    try:
        engine = ray.get_actor(f"{name}.engine", namespace=NAMESPACE)
    except ValueError:
        raise RequestError(
            f"no deployment named {name!r} in namespace {NAMESPACE!r}; running ones: "
            f"{sorted(list_deployments())}"
        ) from None
    spec = ray.get(engine.config.remote())
    merges = [ray.get_actor(n, namespace=NAMESPACE) for n in spec["merge_names"]]
    return {"engine": engine, "merges": merges, "spec": spec}


def list_deployments() -> list[str]:
    from ray.util import list_named_actors

    return [a["name"][: -len(".engine")] for a in list_named_actors(all_namespaces=True)
            if a.get("namespace") == NAMESPACE and a["name"].endswith(".engine")]


def shutdown(handles: dict[str, Any], timeout_s: float = 60.0) -> None:
    """Stop the engine (its engine core removes the rank actors and placement group), then the actors."""
    engine = handles["engine"]
    try:
        ray.get(engine.shutdown.remote(), timeout=timeout_s)
    except Exception:
        logger.warning("engine %s did not shut down cleanly; killing it", handles["spec"]["name"], exc_info=True)
    for actor in [engine, *handles["merges"]]:
        try:
            ray.kill(actor)
        except Exception:
            pass
    # Rank actors belong to the engine core's Ray job and die with it; make sure.
    name = handles["spec"]["name"]
    deadline = time.monotonic() + timeout_s
    for rank in _rank_names(name):
        try:
            actor = ray.get_actor(rank, namespace=NAMESPACE)
        except ValueError:
            continue
        ray.kill(actor)
    while _rank_names(name) and time.monotonic() < deadline:
        time.sleep(0.5)
    # Reserved by launch(), so released here too: vLLM often stops its engine-core
    # process before the executor's own shutdown would remove it (routine, not a fault).
    if remove_named_placement_groups(placement_group_name(name)):
        logger.info("engine %s: removed its rank placement group", name)


def _rank_names(name: str) -> list[str]:
    from ray.util import list_named_actors

    names = []
    for actor in list_named_actors(all_namespaces=True):
        if actor.get("namespace") != NAMESPACE:
            continue
        try:
            if RankId.from_actor_name(actor["name"]).engine == name:
                names.append(actor["name"])
        except ValueError:
            continue
    return names
