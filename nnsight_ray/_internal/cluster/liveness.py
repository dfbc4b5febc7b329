"""Who in a deployment is alive, how to say who died, and loops that never stop on an error.

Every actor of a deployment (the engine actor, each merge actor, each rank) is
an ``ActorRecord``: its role, name, Ray actor id and, once known, node and pid.
``read_states`` looks each one up in the GCS actor table by id (not by name: a
rebuilt deployment reuses the names, and the table keeps the dead ones), and
``dead_message`` turns the dead ones into the one message every waiter and
every later call of that deployment gets: what died first, where, and whether
its node is still there.

The watches are logic classes under the actors' thin shells (Ray Serve's
``ActorReplicaWrapper`` shape): ``DeathWatch`` is the engine actor's (who of
its ranks, merge actors and vLLM's engine-core process is gone, the message,
``health()``), ``EngineWatch`` a merge actor's (the engine actor's death, and
the message for a rank failure it saw first). Neither calls Ray: it reaches
the cluster only through the ``Cluster`` readers the shells pass in
(``deploy.gcs_actor_entry``, ``deploy.alive_nodes``), so the unit tests run
them on fake tables, fake clocks and fake pings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ...errors import EngineDeadError

logger = logging.getLogger(__name__)

ENGINE, MERGE, RANK = "engine", "merge", "rank"
# GCS states in which an actor will never serve again.
_GONE = {"DEAD"}


@dataclass(frozen=True)
class ActorRecord:
    """One actor of a deployment. ``label`` is how a message names it (``rank pp1.tp0``)."""

    role: str
    name: str
    actor_id: str | None = None
    node_id: str | None = None
    pid: int | None = None
    label: str = ""

    def describe(self, node_id: str | None = None, node_alive: bool | None = None) -> str:
        """``rank pp1.tp0 (actor llama.pp1.tp0) on node <id> (node alive)``."""
        what = self.label or f"{self.role} actor"
        text = f"{what} (actor {self.name})" if self.label else f"{what} {self.name}"
        node = node_id or self.node_id
        if node:
            text += f" on node {node}"
            if node_alive is not None:
                text += " (node alive)" if node_alive else " (node removed)"
        return text


@dataclass
class ActorState:
    """An ``ActorRecord`` as the GCS last saw it."""

    record: ActorRecord
    state: str = "UNKNOWN"
    node_id: str | None = None
    end_time_ms: float = 0.0
    cause: str = ""

    @property
    def dead(self) -> bool:
        return self.state in _GONE

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.record.role, "name": self.record.name, "state": self.state,
                "node_id": self.node_id or self.record.node_id, "pid": self.record.pid,
                **({"cause": self.cause} if self.cause else {})}


@dataclass(frozen=True)
class DeploymentRecords:
    """Every actor of one deployment: its engine actor, merge actors and ranks (rank order)."""

    engine: ActorRecord
    merges: list[ActorRecord]
    ranks: list[ActorRecord]

    def others(self) -> list[ActorRecord]:
        """Everything the engine actor watches: the merge actors and the ranks."""
        return [*self.merges, *self.ranks]

    def all(self) -> list[ActorRecord]:
        return [self.engine, *self.others()]


def actor_id(handle: Any) -> str:
    """The hex Ray actor id of an actor handle.

    Ray 2.60.0's ``ActorHandle`` has no public accessor for its id (an actor
    can read its own with ``get_runtime_context().get_actor_id()``, a holder
    of its handle cannot), so this reads the handle's private ``_actor_id``
    property: the one place this project does.
    """
    return handle._actor_id.hex()


def rank_records(topology: list[dict[str, Any]]) -> list[ActorRecord]:
    """The ranks of ``EngineActor.get_topology()``, in rank order."""
    return [ActorRecord(RANK, t["actor_name"], t.get("actor_id"), t.get("node_id"), t.get("pid"),
                        label=f"rank pp{t['pp_rank']}.tp{t['tp_rank']}")
            for t in sorted(topology, key=lambda t: t["rank"])]


def last_words_key(actor_id: str) -> str:
    """Where an actor that ends itself on purpose leaves its reason (Ray's internal KV, ``NAMESPACE``)."""
    return f"last_words/{actor_id}"


def death_cause(entry: dict[str, Any]) -> str:
    """Why an actor died, in one line: its own last words if it left any, else the GCS's reason (or empty)."""
    if entry.get("LastWords"):
        return " ".join(str(entry["LastWords"]).split())
    cause = entry.get("DeathCause")
    context = getattr(cause, "actor_died_error_context", None)
    message = getattr(context, "error_message", "") if context is not None else ""
    return " ".join(str(message).split())


def state_of(record: ActorRecord, entry: dict[str, Any] | None) -> ActorState:
    """Read one GCS actor-table entry (``ray._private.state.actors(actor_id)``) for ``record``."""
    if not entry:
        return ActorState(record, "UNKNOWN" if record.actor_id else "UNTRACKED")
    node = (entry.get("Address") or {}).get("NodeID") or record.node_id
    return ActorState(record, str(entry.get("State", "UNKNOWN")), node,
                      float(entry.get("EndTime") or 0), death_cause(entry) if entry.get("State") == "DEAD" else "")


def read_states(records: list[ActorRecord], entry: Callable[[str], dict[str, Any] | None]) -> list[ActorState]:
    """Each record's state through ``entry(actor_id)`` (a GCS read); a failed read is ``UNKNOWN``."""
    states = []
    for record in records:
        try:
            found = entry(record.actor_id) if record.actor_id else None
        except Exception:
            logger.debug("could not read actor %s from the GCS", record.name, exc_info=True)
            found = None
        states.append(state_of(record, found))
    return states


def first_dead(states: list[ActorState]) -> ActorState | None:
    """The dead actor that ended first (None if all are alive)."""
    dead = sorted((s for s in states if s.dead), key=lambda s: s.end_time_ms)
    return dead[0] if dead else None


# The GCS's cause for an actor ended by ``ray.kill``: what vLLM's executor does
# to every rank (survivors included) once its monitor sees one rank fail.
RAY_KILL_CAUSE = "killed by `ray.kill`"


def killed(state: ActorState) -> bool:
    """Ended by ``ray.kill`` (a user, or vLLM's executor stopping the survivors)."""
    return RAY_KILL_CAUSE in state.cause


# The GCS's cause for an actor Ray destroyed with its placement group: a deployment being taken down
# (vLLM's executor stopping after a rank failed, a shutdown), never the first failure while another is dead.
PLACEMENT_GROUP_REMOVED = "placement group was removed"


def torn_down(state: ActorState) -> bool:
    """Destroyed because its placement group was removed."""
    return PLACEMENT_GROUP_REMOVED in state.cause


def orphaned(state: ActorState) -> bool:
    """Ended because its owner did (Ray's "the actor is dead because its owner has died"): a consequence."""
    return "owner" in state.cause.lower()


def on_lost_node(state: ActorState, alive_nodes: set[str] | None) -> bool:
    node = state.node_id or state.record.node_id
    return alive_nodes is not None and node is not None and node not in alive_nodes


def blamed(states: list[ActorState], alive_nodes: set[str] | None = None) -> ActorState | None:
    """The dead actor the deployment's death is put on (None if all are alive).

    First one whose node is gone; then the first to end of a cause of its
    own (neither ``ray.kill``, nor its owner's death, nor its placement
    group's removal); then the first ``ray.kill``ed; then the first to end.
    vLLM's executor ``ray.kill``s every rank once one fails, often before the
    GCS has found the node that took the first one down, a killed engine
    actor takes the ranks its engine-core process owns with it (their end
    time can come first), and a deployment taken down after a rank's death
    removes its placement group, which destroys the ranks still in it; so
    end times alone can blame a survivor.
    """
    dead = sorted((s for s in states if s.dead), key=lambda s: s.end_time_ms)
    lost = [s for s in dead if on_lost_node(s, alive_nodes)]
    own = [s for s in dead if not killed(s) and not orphaned(s) and not torn_down(s)]
    found = lost or own or [s for s in dead if killed(s)] or dead
    return found[0] if found else None


def dead_message(states: list[ActorState], alive_nodes: set[str] | None = None) -> str | None:
    """The engine-dead message for the dead actors among ``states`` (None if none died).

    The one to blame (``blamed``) is named: when one rank dies, vLLM's
    executor stops the others within milliseconds, and only the end times,
    the causes and the nodes tell which went first.
    """
    first = blamed(states, alive_nodes)
    if first is None:
        return None

    def describe(state: ActorState) -> str:
        node = state.node_id or state.record.node_id
        alive = None if alive_nodes is None or node is None else node in alive_nodes
        return state.record.describe(node, alive)

    # Only the first: the ones stopped after it vary with when one looks, and
    # every caller of the deployment gets the same message (health() lists all).
    cause = f" ({first.cause})" if first.cause else ""
    return engine_dead(f"{describe(first)} died{cause}")


def diagnose(states: list[ActorState], alive_nodes: set[str] | None, core_process: str | None) -> str | None:
    """The deployment's death message, or None while everything lives.

    ``core_process`` says how vLLM's engine-core process ended (None while it
    runs). The first actor to die is blamed, unless the core process ended
    and that actor died because its owner (the core, which creates the ranks) did.
    """
    first = blamed(states, alive_nodes)
    if core_process is not None and (first is None or orphaned(first)):
        return engine_dead(core_process)
    return dead_message(states, alive_nodes)


def engine_dead(what: str) -> str:
    """The one wording of a dead deployment: what died, and what to do."""
    return (f"the engine is dead: {what}. Every pending request on it failed; "
            "shut it down (model.shutdown()) and build a new one.")


async def every(period_s: float, step: Callable[[], Awaitable[bool]], what: str) -> None:
    """Run ``step`` every ``period_s`` until it returns True; log its exceptions and go on.

    A watcher that stops at its first exception switches failure detection off
    for good, silently; this one keeps watching (cancel the task to stop it).
    """
    failures = 0
    while True:
        try:
            if await step():
                return
            failures = 0
        except asyncio.CancelledError:
            raise
        except Exception:
            failures += 1
            # Every time at first, then once a minute-ish: a GCS outage should not flood the log.
            if failures <= 3 or failures % 60 == 0:
                logger.warning("%s: a check failed (%d in a row); still watching", what, failures, exc_info=True)
        await asyncio.sleep(period_s)


def as_dicts(states: list[ActorState]) -> list[dict[str, Any]]:
    return [s.as_dict() for s in states]


async def in_thread(read: Callable[[], Any]) -> Any:
    """Run a blocking read (a GCS call) off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, read)


@dataclass(frozen=True)
class Cluster:
    """How a watch reads the cluster: injected, so the logic runs on fakes.

    ``entry(actor_id)`` is an actor's GCS actor-table entry (or None) and
    ``alive_nodes()`` the ids of the live nodes, both blocking; ``offload``
    runs a blocking read off the event loop and ``sleep`` waits between retries.
    """

    entry: Callable[[str], dict[str, Any] | None]
    alive_nodes: Callable[[], set[str]]
    offload: Callable[[Callable[[], Any]], Awaitable[Any]] = in_thread
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep

    def message(self, records: list[ActorRecord]) -> str | None:
        """The death message for the dead among ``records`` (blocking), None while they all live."""
        return dead_message(read_states(records, self.entry), self.alive_nodes())

    def actor_died(self, record: ActorRecord | None, error: BaseException | None = None) -> str:
        """The engine-dead message for one actor found dead (blocking: reads the GCS)."""
        if record is None:
            return engine_dead(f"an actor of the deployment died ({error})")
        return self.message([record]) or engine_dead(
            f"{record.describe()} died ({type(error).__name__ if error else 'gone'})")


class DeathWatch:
    """The engine actor's watch over its deployment: what died, in the one message; ``health()``.

    ``core_processes()`` lists vLLM's engine-core processes (``multiprocessing``
    handles with ``pid`` and ``exitcode``; ``EngineCore.core_processes``).
    """

    # vLLM may say the engine is dead a moment before the GCS marks the actor that took it down.
    DESCRIBE_ATTEMPTS = 5
    DESCRIBE_RETRY_S = 1.0
    # While every death seen is a `ray.kill` (vLLM's executor stopping its ranks),
    # how long to give the GCS to find a lost node behind it (its health check
    # takes ~3 s with the settings cluster_configs/ use; docs/clusters.md).
    KILL_GRACE_S = 3.0

    def __init__(self, records: DeploymentRecords, cluster: Cluster,
                 core_processes: Callable[[], list[Any]] = list,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.records = records
        self.cluster = cluster
        self.core_processes = core_processes
        self.clock = clock
        self._kills_seen_at: float | None = None

    def survey(self) -> list[ActorState]:
        """Every actor of this deployment as the GCS actor table has it (blocking: run in a thread).

        Read by actor id from the GCS (the data behind ``ray list actors``)
        because it keeps *when* each actor ended: vLLM's executor kills the
        surviving ranks within milliseconds of the first death, and only the
        end times tell which one went first. The engine actor is the one asking.
        """
        states = read_states(self.records.others(), self.cluster.entry)
        return [ActorState(self.records.engine, "ALIVE", self.records.engine.node_id), *states]

    def core_process(self) -> str | None:
        """``engine core process pid P exited with code C`` if vLLM's engine-core process has ended."""
        ended = [p for p in self.core_processes() if p.exitcode is not None]
        if not ended:
            return None
        return "; ".join(f"vLLM's engine core process (pid {p.pid}) of {self.records.engine.describe()} "
                         f"exited with code {p.exitcode}" for p in ended)

    async def diagnose(self) -> str | None:
        """The death message if vLLM's engine-core process, a rank or a merge actor is gone (``diagnose``).

        Held back for up to ``KILL_GRACE_S`` while the only deaths are ranks
        ``ray.kill``ed on live nodes (what vLLM's executor does to every rank
        once one fails), or destroyed with their placement group: a lost node
        behind them is blamed once the GCS finds it; a user's own ``ray.kill``
        of a rank is named after the grace.
        """
        states = await self.cluster.offload(self.survey)
        # The live nodes matter only to place a death (``blamed``): while every actor lives, once a second per
        # engine, the node table is not read.
        alive = await self.cluster.offload(self.cluster.alive_nodes) if any(s.dead for s in states) else None
        core = self.core_process()
        message = diagnose(states, alive, core)
        dead = [s for s in states if s.dead]
        if message is not None and core is None and all(
                s.record.role == RANK and (killed(s) or torn_down(s)) and not on_lost_node(s, alive) for s in dead):
            now = self.clock()
            if self._kills_seen_at is None:
                self._kills_seen_at = now
            if now - self._kills_seen_at < self.KILL_GRACE_S:
                return None
        return message

    async def describe_dead(self) -> str:
        """What killed the engine, once vLLM said it is dead (the GCS may learn of a death a moment later)."""
        for _ in range(self.DESCRIBE_ATTEMPTS):
            message = await self.diagnose()
            if message is not None:
                return message
            await self.cluster.sleep(self.DESCRIBE_RETRY_S)
        return engine_dead(f"vLLM's engine core in {self.records.engine.describe()} failed with every actor "
                           "alive (see the engine actor's log)")

    async def check(self, core: Any) -> bool:
        """One watch step: fail ``core`` (an ``EngineCore``) as soon as an actor is gone, or vLLM errored.

        vLLM's executor notices a dead rank too, but a core blocked mid-step
        (a collective with the dead peer) may never report it; this does not
        depend on that. True once the engine is dead (the watch ends).
        """
        if core is None or core.dead is not None:
            return core is not None
        message = await self.diagnose()
        if message is None and getattr(core.llm, "errored", False):
            message = await self.describe_dead()
        if message is not None:
            await core.fail(EngineDeadError(message))
            return True
        return False

    async def health(self, core: Any, uptime_s: float) -> dict[str, Any]:
        """Alive only if every actor of the deployment is: the engine, each merge actor, each rank."""
        if core.dead is None:
            await self.check(core)
        states = await self.cluster.offload(self.survey)
        error = None if core.dead is None else str(core.dead)
        if error is None and any(s.dead for s in states):  # a death the engine is still holding back
            error = dead_message(states, await self.cluster.offload(self.cluster.alive_nodes))
        return {"alive": error is None, "error": error,
                "actors": as_dicts(states), "uptime_s": uptime_s,
                "collect": dict(core.collect_stats), "core_pids": [p.pid for p in self.core_processes()]}


class EngineWatch:
    """A merge actor's watch: the engine actor's death, and the message for a failure seen here first.

    ``book`` is the merge actor's ``merge.book.MergeBook`` (``dead``, ``fail``,
    ``death``); ``ping()`` asks the engine actor whether it answers, and
    raises one of ``gone`` once it is dead (Ray's ``RayActorError``).
    """

    def __init__(self, name: str, book: Any, cluster: Cluster, gone: tuple[type[BaseException], ...],
                 ping_timeout_s: float, declared_wait_s: float) -> None:
        self.name = name
        self.book = book
        self.cluster = cluster
        self.gone = gone
        self.ping_timeout_s = ping_timeout_s
        self.declared_wait_s = declared_wait_s
        self.ranks: list[ActorRecord] = []
        self.engine: ActorRecord | None = None

    def watch(self, ranks: list[ActorRecord], engine: ActorRecord | None) -> None:
        """The ranks (rank order) and the engine actor of this deployment."""
        self.ranks, self.engine = list(ranks), engine

    def fail(self, message: str) -> None:
        """The deployment is dead: every waiter here, and every later wait, fails with ``message``."""
        if self.book.dead is None:
            logger.error("%s: %s", self.name, message)
        self.book.fail(message)

    async def engine_gone(self, ping: Callable[[], Awaitable[Any]]) -> bool:
        """One look at the engine actor; True (and every waiter failed) once it is dead."""
        if self.book.dead is not None:
            return True
        try:
            await asyncio.wait_for(ping(), self.ping_timeout_s)
        except self.gone as error:
            engine, died = self.engine, error
            self.fail(await self.cluster.offload(lambda: self.cluster.actor_died(engine, died)))
            return True
        except asyncio.TimeoutError:
            logger.warning("%s: the engine actor did not answer a ping within %.0f s", self.name, self.ping_timeout_s)
        return False

    async def death_message(self, what: str) -> str:
        """The deployment's one death message, for a failure seen here first (``what``).

        The rank that failed to hand over is often not the one that died (vLLM
        stops the other ranks when one dies), and the engine actor, which
        watches every actor and vLLM's engine-core process, declares the death
        to every merge actor within a second or two (``fail``). So wait for
        that word; if it does not come in time, name the first actor the GCS
        saw die, as the engine would.
        """
        declared = await self.book.death(self.declared_wait_s)
        if declared is not None:
            return declared
        records = [*self.ranks, *([self.engine] if self.engine else [])]
        states = await self.cluster.offload(lambda: read_states(records, self.cluster.entry))
        return dead_message(states, await self.cluster.offload(self.cluster.alive_nodes)) or engine_dead(what)
