"""When an engine did what: its steps (on each rank) and its requests' submits, adds and ends (engine actor).

Every process keeps its last ``SIZE`` events, stamped with ``time.monotonic()``
(the same clock in every process of a host), so a run's timeline can be put
together afterwards (``RayVLLM.timeline``; ``python -m benchmarks.gpu`` prints one
line per workload): how long the GPU waited for its first step, how many steps
ran part-empty, the gaps between steps, how long results took to come home.
Recording is a ``deque.append`` per step and per request.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Iterable

SIZE = 16384

# Event kinds. A step's value is its scheduled tokens and it carries its end time;
# the engine actor's carry a count (prompts submitted, requests added, requests ended).
STEP, SUBMIT, RENDER, ADDED, ENDED, COLLECT, GC = "step", "submit", "render", "added", "ended", "collect", "gc"
# The merge actors': payloads fetched from the ranks (value: requests), a batch merged, a result handed back.
FETCH, MERGED, HANDED = "fetch", "merged", "handed"
# The caller's (``CALLER``): a trace's requests built (nnsight's attach, value: requests), requests sent to the engine.
ATTACHED, SENT = "attached", "sent"

# A garbage collection shorter than this is not recorded.
GC_MIN_S = 0.002


class Timeline:
    """A process's last ``SIZE`` events: ``(time, kind, value, end)``."""

    def __init__(self, size: int = SIZE) -> None:
        self.events: collections.deque = collections.deque(maxlen=size)

    def mark(self, kind: str, value: int = 1, began: float | None = None) -> None:
        now = time.monotonic()
        self.events.append((now if began is None else began, kind, value, now))

    def since(self, t: float) -> list[tuple]:
        return [e for e in self.events if e[0] >= t]

# This process's garbage collections of GC_MIN_S or more (value: the generation), once ``watch_gc`` ran.
GC_EVENTS = Timeline()
# The caller's process: its traces' attaches and its sends (``LocalVLLM._attach_mediators``, ``RemoteEngine.submit``).
CALLER = Timeline(size=1024)
_gc_watched = False


def watch_gc() -> None:
    """Record this process's long garbage collections in ``GC_EVENTS`` (idempotent: one callback a process)."""
    global _gc_watched
    if _gc_watched:
        return
    import gc

    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.monotonic()
        elif time.monotonic() - started[0] >= GC_MIN_S:
            GC_EVENTS.mark(GC, info.get("generation", -1), started[0])

    gc.callbacks.append(callback)
    _gc_watched = True


def with_gc(events: list[tuple], since: float) -> list[tuple]:
    """``events`` and this process's long garbage collections from ``since`` on, by time."""
    return sorted(events + GC_EVENTS.since(since), key=lambda e: e[0])


def _pauses(events: list[tuple], who: str) -> str:
    gcs = _of(events, GC)
    if not gcs:
        return ""
    longest = max(e[3] - e[0] for e in gcs)
    generations = "/".join(str(g) for g in sorted({e[2] for e in gcs}))  # 2: a full collection
    return (f"{who} gc {len(gcs)}x {sum(e[3] - e[0] for e in gcs) * 1e3:,.0f} (longest {longest * 1e3:,.0f}, "
            f"generation {generations})")


def _of(events: list[tuple], kind: str) -> list[tuple]:
    return [e for e in events if e[1] == kind]


def summarize(began: float, ended: float, actor: Iterable[tuple], steps: Iterable[tuple],
              merges: Iterable[tuple] = (), caller: Iterable[tuple] = ()) -> str:
    """One run's timeline in a line, times in ms from ``began`` (the caller's call) to ``ended`` (its result).

    ``actor``: the engine actor's events; ``steps``: one rank's; ``merges``: the
    merge actors' (fetches from the ranks, merges, results handed back); ``caller``: the
    calling process's (a trace's attach, the send; its long garbage collections). "Between" is the
    time from one step's end to the next one's start (the rank waiting for work);
    a step with under half the tokens of the run's largest counts as part-empty.
    """
    ms = lambda t: f"{(t - began) * 1e3:,.0f}"  # noqa: E731
    actor = [e for e in actor if began <= e[0] <= ended]
    rank = [e for e in steps if began <= e[0] <= ended]
    steps = sorted((e for e in rank if e[1] == STEP), key=lambda e: e[0])
    parts = []
    caller = [e for e in caller if began <= e[0] <= ended]
    attached, sent = _of(caller, ATTACHED), _of(caller, SENT)
    if attached:
        parts.append(f"attached {sum(e[2] for e in attached)} +{ms(attached[0][0])}..+{ms(attached[-1][3])}")
    if sent:
        parts.append(f"sent +{ms(sent[0][0])}..+{ms(sent[0][3])}")
    submits = _of(actor, SUBMIT)
    adds = _of(actor, ADDED)
    ends = _of(actor, ENDED)
    if submits:
        parts.append(f"submit +{ms(submits[0][0])}")
    renders = _of(actor, RENDER)
    if renders:
        parts.append(f"rendered {sum(e[2] for e in renders)} in {len(renders)} +{ms(renders[0][0])}..+{ms(renders[-1][3])} "
                     f"(longest {max(e[3] - e[0] for e in renders) * 1e3:,.0f})")
    if adds:
        parts.append(f"added {sum(e[2] for e in adds)} by +{ms(adds[0][3])}..+{ms(adds[-1][3])}")
    if steps:
        busy = sum(e[3] - e[0] for e in steps)
        gaps = [b[0] - a[3] for a, b in zip(steps, steps[1:])]
        tokens = [e[2] for e in steps]
        small = sum(1 for t in tokens if t < max(tokens) / 2)
        parts.append(f"{len(steps)} steps +{ms(steps[0][0])}..+{ms(steps[-1][3])}, in steps {busy * 1e3:,.0f}, "
                     f"between {sum(gaps) * 1e3:,.0f} (median {statistics.median(gaps) * 1e3 if gaps else 0:.1f}, "
                     f"max {max(gaps, default=0) * 1e3:.1f})"
                     + f", {small} under half full; tokens {tokens[:6]}{'...' if len(tokens) > 6 else ''}")
    if ends:
        parts.append(f"{sum(e[2] for e in ends)} ended by +{ms(ends[-1][3])}")
    collects = _of(actor, COLLECT)
    if collects:
        parts.append(f"collected {sum(e[2] for e in collects)} in {len(collects)} stash calls, the last "
                     f"+{ms(collects[-1][0])}..+{ms(collects[-1][3])}")
    merges = [e for e in merges if began <= e[0] <= ended]
    fetches = _of(merges, FETCH)
    if fetches:
        parts.append(f"merge fetched {sum(e[2] for e in fetches)} in {len(fetches)}, the last "
                     f"+{ms(fetches[-1][0])}..+{ms(fetches[-1][3])}")
    merged = _of(merges, MERGED)
    if merged:
        parts.append(f"merged by +{ms(merged[-1][3])}")
    handed = _of(merges, HANDED)
    if handed:
        parts.append(f"handed +{ms(handed[-1][3])}")
    parts.append(f"result +{ms(ended)}")
    parts += [p for p in (_pauses(caller, "caller"), _pauses(actor, "engine"), _pauses(rank, "rank"),
                          _pauses(merges, "merge")) if p]
    return "; ".join(parts)

