"""The Ray edge: actor classes, their options, deploy / connect / shutdown.

All ``ray.remote`` options (names, namespace, lifetime, resources, runtime env)
are applied here and nowhere else; the logic lives in ``engine.py`` and
``merge.py`` and never calls Ray itself.

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
from .merge import Group, merge_request, trace_result
from .options import NAMESPACE, RankPlacement, placement_group_name, remove_named_placement_groups, reserve_placement_group
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


# Per-node settings: forwarding them would make a remote node advertise this one's.
_NODE_LOCAL_ENV = {"VLLM_HOST_IP", "VLLM_PORT", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "OMP_PLACES"}


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(_FORWARDED_ENV_PREFIXES) and k not in _NODE_LOCAL_ENV}


def merge_index(group: str, shards: int) -> int:
    """Which merge shard serves a group: stable across processes (not Python's hash)."""
    return zlib.crc32(group.encode()) % shards


def _import_rank_class() -> None:
    try:
        from . import ray_executor  # noqa: F401
    except Exception:  # only a warm-up: set_ranks reports a real problem
        logger.debug("could not import the rank actor class", exc_info=True)


class MergeActor:
    """Takes each finished request's payloads from every rank, merges, resolves callers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ranks: list[Any] = []
        self.groups: dict[str, Group] = {}
        self.waiters: dict[str, asyncio.Event] = {}
        self.bytes_merged = 0
        self.requests_merged = 0  # finished requests handed over by the engine
        self.groups_expired = 0  # dropped by the sweep: caller gone, or never came for them
        self._sweeper: asyncio.Task | None = None
        # A handle on a rank actor (set_ranks) loads the rank's class, whose
        # module imports vLLM: ~7 s on the engine's start-up path if left until
        # then. Import it now, while the engine actor is still starting vLLM.
        threading.Thread(target=_import_rank_class, name="nnsight-ray-prewarm", daemon=True).start()

    def set_ranks(self, actor_names: list[str]) -> None:
        """Rank actors in rank order (rank = pp * tp_size + tp): the merge order."""
        self.ranks = [ray.get_actor(n, namespace=NAMESPACE) for n in actor_names]

    def _group(self, group: str) -> Group:
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_forever())
        return self.groups.setdefault(group, Group(size=0))

    def _sweep(self) -> None:
        now = time.monotonic()
        for key, state in list(self.groups.items()):
            if state.expired(now, key in self.waiters, ABANDON_AFTER_S, GROUP_TTL_S):
                del self.groups[key]
                self.groups_expired += 1

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(ABANDON_AFTER_S / 3)
            self._sweep()

    async def finish(self, reports: list[tuple[str, int, str, Any, BaseException | None]]) -> None:
        """Merge a batch of finished requests: one ``take_payloads`` per rank for all of them."""
        request_ids = [rid for _, _, rid, _, _ in reports]
        per_rank: list[list[bytes | None]] = []
        failure = None
        try:
            per_rank = await asyncio.gather(*(r.take_payloads.remote(request_ids) for r in self.ranks))
        except Exception as exception:  # a rank died between collect and take
            failure = EngineDeadError(f"could not take saves from a rank: {exception}")
        now = time.monotonic()
        for position, (group, index, request_id, output, error) in enumerate(reports):
            payloads = [taken[position] for taken in per_rank]
            self.bytes_merged += sum(len(p) for p in payloads if p)
            self.requests_merged += 1
            state = self._group(group)
            error = error or failure
            if error is not None:
                state.error = state.error or error
            else:
                state.outputs[index] = merge_request(output, request_id, payloads)
            state.finished = now  # last activity: see Group.expired
            self._wake(group)

    def _wake(self, group: str) -> None:
        event = self.waiters.get(group)
        if event is not None:
            event.set()

    async def _wait(self, group: str, size: int) -> Group:
        state = self._group(group)
        state.size = size
        event = self.waiters.setdefault(group, asyncio.Event())
        try:
            while not state.complete:
                event.clear()
                await event.wait()
        finally:
            self.waiters.pop(group, None)
            self.groups.pop(group, None)
        return state

    async def outputs(self, group: str, size: int) -> list[Any]:
        """The group's ``RequestOutput``s, saves attached (raises the group's error)."""
        state = await self._wait(group, size)
        if state.error is not None:
            raise state.error
        from .payload import Packed  # Ray writes the saves with the fast tensor path

        return Packed(state.ordered())

    async def trace(self, group: str, size: int, presaved: set[str]) -> dict[str, Any]:
        """``{"saves": {name: value}, "error": deferred}`` for a non-blocking trace."""
        state = await self._wait(group, size)
        if state.error is not None:
            raise state.error
        from .payload import Packed

        return Packed(trace_result(state.ordered(), presaved))

    def stats(self) -> dict[str, Any]:
        self._sweep()
        return {"groups": len(self.groups), "waiting": len(self.waiters), "bytes_merged": self.bytes_merged,
                "requests_merged": self.requests_merged, "groups_expired": self.groups_expired}


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
        from .options import configure_engine_kwargs, release_placement_group

        VLLM._require_v1_model_runner()
        kwargs = platform.engine_defaults(self.spec["engine_kwargs"])
        # nnsight's engine defaults (VLLM._load): a traced prompt is prefilled in
        # one forward and every token runs a forward pass.
        kwargs.setdefault("enable_chunked_prefill", False)
        kwargs.setdefault("enable_prefix_caching", False)
        kwargs.update(distributed_executor_backend="ray", **self.spec["placement"])
        kwargs = configure_engine_kwargs(kwargs)
        began = time.monotonic()
        try:
            args = AsyncEngineArgs(model=self.spec["model"], worker_cls=platform.worker_cls(), enforce_eager=True, **kwargs)
            llm = AsyncLLM.from_engine_args(args)
        except BaseException:
            release_placement_group(kwargs)
            raise
        vllm_up = time.monotonic()
        self.merges = [ray.get_actor(n, namespace=NAMESPACE) for n in self.spec["merge_names"]]
        self.core = EngineCore(llm, self._notify, self._describe_dead)
        self.topology = await llm.collective_rpc("nnsight_ray_describe")
        described = time.monotonic()
        names = [t["actor_name"] for t in sorted(self.topology, key=lambda t: t["rank"])]
        await asyncio.gather(*(m.set_ranks.remote(names) for m in self.merges))
        logger.info("engine %s: imports %.1f s, vLLM engine %.1f s, describe %.1f s, merges %.1f s",
                    self.spec["name"], began - self.started, vllm_up - began, described - vllm_up,
                    time.monotonic() - described)
        self._watcher = asyncio.ensure_future(self._watch_ranks())
        logger.info("engine %s ready: %d ranks", self.spec["name"], len(names))
        return self.topology

    def _notify(self, reports: list) -> None:
        shards: dict[int, list] = {}
        for report in reports:
            shards.setdefault(merge_index(report[0], len(self.merges)), []).append(report)
        for shard, batch in shards.items():
            self.merges[shard].finish.remote(batch)

    def _dead_ranks(self) -> list[str]:
        """Dead rank actors, the first to die first, each with its node.

        Read from the GCS actor table (``ray._private.state.actors``, the data
        behind ``ray list actors``) because it keeps *when* each actor ended:
        vLLM's executor kills the surviving ranks within milliseconds of the
        first death, and only the end times tell which one went first.
        """
        import ray._private.state as ray_state

        alive_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        ours = {(t["actor_name"], t["pid"]): t for t in self.topology}
        ended = []
        for actor in ray_state.actors().values():
            rank = ours.get((actor.get("Name"), actor.get("Pid")))
            if rank is not None and actor.get("State") == "DEAD":
                ended.append((actor.get("EndTime") or 0, rank))
        described = []
        for _, rank in sorted(ended, key=lambda item: item[0]):
            node = rank["node_id"]
            where = "node removed" if node not in alive_nodes else "node alive"
            described.append(f"rank pp{rank['pp_rank']}.tp{rank['tp_rank']} (actor {rank['actor_name']}) "
                             f"on node {node} ({where})")
        return described

    async def _watch_ranks(self, period_s: float = 1.0) -> None:
        """Fail the engine as soon as a rank is gone, whatever vLLM's core is doing.

        vLLM's executor notices a dead rank too, but a core blocked mid-step
        (a collective with the dead peer) may never report it; this loop does
        not depend on that.
        """
        while self.core is not None and self.core.dead is None:
            try:
                dead = await asyncio.get_running_loop().run_in_executor(None, self._dead_ranks)
            except Exception:  # the cluster is going away
                return
            if dead:
                await self.core.fail(EngineDeadError(self._dead_message(dead)))
                return
            await asyncio.sleep(period_s)

    @staticmethod
    def _dead_message(dead: list[str]) -> str:
        first, rest = dead[0], dead[1:]
        tail = f" (then {len(rest)} more rank(s) were stopped: {'; '.join(rest)})" if rest else ""
        return (f"the engine is dead: {first} died{tail}. Every pending request on it failed; "
                "shut it down (model.shutdown()) and build a new one.")

    async def _describe_dead(self) -> str:
        dead = await asyncio.get_running_loop().run_in_executor(None, self._dead_ranks)
        if dead:
            return self._dead_message(dead)
        return "the engine is dead: vLLM's engine core failed with every rank alive (see the engine actor's log)"

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
            self._notify([(group, index, f"{group}-{index}", None, error) for index in range(len(prompts))])

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

    async def health(self) -> dict[str, Any]:
        core = self._require_core()
        if core.dead is None and getattr(core.llm, "errored", False):
            await core._explain(RuntimeError("engine errored"))
        return {"alive": core.dead is None, "error": None if core.dead is None else str(core.dead),
                "uptime_s": time.monotonic() - self.started, "collect": dict(core.collect_stats)}

    async def shutdown(self) -> None:
        # The executor removes the rank placement group; if vLLM stopped its
        # engine core first, deploy.shutdown removes it by name afterwards.
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:  # ranks stopping now are not a failure to report
            watcher.cancel()
        if self.core is not None:
            self.core.llm.shutdown()


def deploy(name: str, model: str, engine_kwargs: dict[str, Any], placement: RankPlacement,
           num_merge_actors: int = 1, detached: bool = False, start_timeout_s: float = 600.0,
           engine_actor_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Create the merge and engine actors and wait for the engine to come up (``launch`` + ``wait_started``)."""
    return wait_started(launch(name, model, engine_kwargs, placement, num_merge_actors=num_merge_actors,
                               detached=detached, engine_actor_options=engine_actor_options), start_timeout_s)


def launch(name: str, model: str, engine_kwargs: dict[str, Any], placement: RankPlacement,
           num_merge_actors: int = 1, detached: bool = False,
           engine_actor_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reserve the ranks' placement group, create the merge and engine actors, start the engine; don't wait.

    Returns the deployment's handles with the pending start; ``wait_started``
    waits for it (and cleans up if it failed). Meanwhile the caller can build
    its client, or launch other deployments: an engine start is mostly
    waiting for processes to come up and import vLLM, so several overlap well.

    ``engine_actor_options`` are extra ``.options()`` for the engine actor, e.g.
    ``{"resources": {"gpu_node": 0.01}}`` to keep vLLM's engine core off a
    CPU-only head node of a GPU cluster (docs/clusters.md).
    """
    placement = placement.model_copy(update={"engine_name": name})
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
    # vLLM. Released at shutdown: by the executor, or by name in shutdown().
    placement = reserve_placement_group(placement, engine_kwargs)
    runtime_env = {"env_vars": forwarded_env()}
    merges = [
        ray.remote(MergeActor).options(name=n, namespace=NAMESPACE, lifetime=lifetime, num_cpus=0,
                                       runtime_env=runtime_env).remote(n)
        for n in merge_names
    ]
    spec = {"name": name, "model": model, "engine_kwargs": engine_kwargs,
            "placement": placement.model_dump(exclude_none=True), "merge_names": merge_names,
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
        if handles["spec"]["placement"].get("owns_placement_group"):
            remove_named_placement_groups(placement_group_name(handles["spec"]["name"]))
        if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
            raise error.cause from None
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
