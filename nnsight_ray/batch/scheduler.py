"""Which prompts go to which engine next, and what a failure does to them. No Ray.

Work is a queue of *chunks*: up to ``prompts_per_trace`` prompts of one shard,
sent as one trace with one invoke per prompt. Shards open in order, so only a
few are held in memory at a time and finish roughly in order. Engine replicas
pull chunks while they have room in their in-flight window.

Three outcomes per chunk, each with one rule:

- *values*: each prompt's row is recorded; a shard whose every prompt has a row
  is complete and handed back for writing.
- *request failure* (an intervention raised, a prompt was refused): a chunk of
  several prompts is split into single-prompt chunks at the front of the queue
  so the failing prompt is found; a single prompt's failure is its row's error.
- *lost* (the engine died or timed out under it): the chunk goes back to the
  front of the queue. Each engine failure counts once against every shard it
  hit; a shard hit more than ``shard_retries`` times is failed (not written,
  reported, redone by the next run). Prompts are never dropped silently.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from .shards import ShardPlan

__all__ = ["Chunk", "Scheduler", "ShardState"]


@dataclass(frozen=True)
class Chunk:
    shard: int
    positions: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.positions)


@dataclass
class ShardState:
    plan: ShardPlan
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    failures: set[str] = field(default_factory=set)
    replicas: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.rows) == len(self.plan.prompts)

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [{"id": p.id, **self.rows[p.id]["error_info"]} for p in self.plan.prompts
                if self.rows[p.id].get("error_info")]


class Scheduler:
    def __init__(self, plans: Iterable[ShardPlan], prompts_per_trace: int, shard_retries: int) -> None:
        self.prompts_per_trace = prompts_per_trace
        self.shard_retries = shard_retries
        self.waiting: deque[ShardPlan] = deque(plans)
        self.queue: deque[Chunk] = deque()
        self.open: dict[int, ShardState] = {}
        self.failed: dict[int, str] = {}

    @property
    def done(self) -> bool:
        return not self.waiting and not self.queue and not self.open

    def next_chunk(self, room: int) -> Chunk | None:
        """The next chunk if it fits in ``room`` prompts."""
        if not self.queue and self.waiting:
            self._open(self.waiting.popleft())
        if self.queue and len(self.queue[0]) <= room:
            return self.queue.popleft()
        return None

    def prompts(self, chunk: Chunk) -> list[str]:
        plan = self.open[chunk.shard].plan
        return [plan.prompts[i].text for i in chunk.positions]

    def started(self, chunk: Chunk, replica: str) -> None:
        self.open[chunk.shard].replicas.add(replica)

    def succeeded(self, chunk: Chunk, values: list[Any]) -> ShardState | None:
        """Record a chunk's per-prompt ``{name: value}``; the shard if now complete."""
        state = self.open.get(chunk.shard)
        if state is None:  # the shard failed meanwhile
            return None
        for position, value in zip(chunk.positions, values):
            prompt = state.plan.prompts[position]
            if isinstance(value, dict):
                state.rows[prompt.id] = {"values": value, "error": None}
            else:
                self._error(state, position, {"type": "MissingValues",
                                              "message": f"the trace returned no values for this prompt ({value!r})"})
        return self._finish(state)

    def request_failed(self, chunk: Chunk, error: dict[str, Any]) -> ShardState | None:
        """A chunk's trace failed: isolate the prompt(s), or record the single prompt's error."""
        state = self.open.get(chunk.shard)
        if state is None:
            return None
        if len(chunk) > 1:
            self.queue.extendleft(Chunk(chunk.shard, (p,)) for p in reversed(chunk.positions))
            return None
        self._error(state, chunk.positions[0], error)
        return self._finish(state)

    def lost(self, chunk: Chunk, failure: str) -> int | None:
        """The engine failed under a chunk; requeue it, or fail its shard. Returns a failed shard's index."""
        state = self.open.get(chunk.shard)
        if state is None:
            return None
        state.failures.add(failure)
        if len(state.failures) > self.shard_retries:
            del self.open[chunk.shard]
            self.queue = deque(c for c in self.queue if c.shard != chunk.shard)
            self.failed[chunk.shard] = (
                f"{len(state.failures)} engine failures under it (runner.shard_retries={self.shard_retries}); last: {failure}"
            )
            return chunk.shard
        self.queue.appendleft(chunk)
        return None

    def abandon(self, reason: str) -> list[int]:
        """No engine left: every unfinished shard fails with ``reason``."""
        indices = sorted({*self.open, *(p.index for p in self.waiting)})
        for index in indices:
            self.failed[index] = reason
        self.open.clear()
        self.waiting.clear()
        self.queue.clear()
        return indices

    def _open(self, plan: ShardPlan) -> None:
        self.open[plan.index] = ShardState(plan)
        positions = range(len(plan.prompts))
        size = self.prompts_per_trace
        self.queue.extend(Chunk(plan.index, tuple(positions[i : i + size])) for i in range(0, len(positions), size))

    def _error(self, state: ShardState, position: int, error: dict[str, Any]) -> None:
        prompt = state.plan.prompts[position]
        info = {"type": error.get("type", "Exception"), "message": error.get("message", "")}
        if error.get("traceback"):
            info["traceback"] = error["traceback"]
        state.rows[prompt.id] = {"values": None, "error": f"{info['type']}: {info['message']}", "error_info": info}

    def _finish(self, state: ShardState) -> ShardState | None:
        if state.complete:
            del self.open[state.plan.index]
            return state
        return None
