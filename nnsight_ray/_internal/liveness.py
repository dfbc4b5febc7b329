"""Who in a deployment is alive, how to say who died, and loops that never stop on an error.

Every actor of a deployment (the engine actor, each merge actor, each rank) is
an ``ActorRecord``: its role, name, Ray actor id and, once known, node and pid.
``read_states`` looks each one up in the GCS actor table by id (not by name: a
rebuilt deployment reuses the names, and the table keeps the dead ones), and
``dead_message`` turns the dead ones into the one message every waiter and
every later call of that deployment gets: what died first, where, and whether
its node is still there.

Pure logic apart from ``gcs_actor_entry`` (the GCS read), which the callers
pass in, so the unit tests run on fake tables.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

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


def rank_records(topology: list[dict[str, Any]]) -> list[ActorRecord]:
    """The ranks of ``EngineActor.get_topology()``, in rank order."""
    return [ActorRecord(RANK, t["actor_name"], t.get("actor_id"), t.get("node_id"), t.get("pid"),
                        label=f"rank pp{t['pp_rank']}.tp{t['tp_rank']}")
            for t in sorted(topology, key=lambda t: t["rank"])]


def death_cause(entry: dict[str, Any]) -> str:
    """The GCS's reason for an actor's death, in one line (empty if it gives none)."""
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


def dead_message(states: list[ActorState], alive_nodes: set[str] | None = None) -> str | None:
    """The engine-dead message for the dead actors among ``states`` (None if none died).

    The first to die is named first: when one rank dies, vLLM's executor stops
    the others within milliseconds, and only the end times tell which went first.
    """
    first = first_dead(states)
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
    first = first_dead(states)
    if core_process is not None and (first is None or "owner" in first.cause.lower()):
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
