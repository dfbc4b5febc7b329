"""Who is sending code, and what a tenant whose blocks keep running away gets: a cool-down.

A block is stopped on the rank when it runs past its deadline
(``BlockTimeoutError``); until then it held the model's thread, and every
request in its engine's batch waited. Deadlines bound one block; they do not
bound a tenant who sends one runaway block after another: at one per deadline
the engine would do nothing else. So the application keeps a small book per
tenant (in its ``NNsightJobs`` deployment, so it holds on every replica): when
one of a tenant's traces ends with its block stopped after holding an engine
``h`` seconds, that tenant's new traces (``serve=`` and ``remote=True``) are
refused (HTTP 429, ``Retry-After``) for ``runaway_penalty x h`` seconds, the
cool-downs adding up; and for ``PROBATION_S`` after its last stop it may have
only one trace in flight, so it cannot queue a second runaway behind the first
before the first is charged. A tenant can then take at most
``1 / (1 + runaway_penalty)`` of the application's engine time with runaway
blocks (a quarter at the default of 3), whatever its rate, besides the traces
it had in flight when its first stop came; a block that ends within its
deadline costs nothing.

Tenants are told apart by their API key: ``build_app(api_keys={name: key})``
gives each its own (the key's name is the tenant). With no key, or one key
for everyone, every caller is one tenant, and the cool-down would punish all of
them for one, so it is off (a replica says so in its log at start).

Pure logic on a clock: unit-tested on its own (``tests/unit/test_tenants_unit.py``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ..errors import held_seconds

__all__ = ["DEFAULT_RUNAWAY_PENALTY", "Refusal", "TenantBook"]

DEFAULT_RUNAWAY_PENALTY = 3.0
PROBATION_S = 60.0  # after a tenant's last stop: one trace in flight at a time


@dataclass
class Standing:
    refused_until: float = 0.0
    stops: int = 0
    held_s: float = 0.0
    last_stop: float = float("-inf")
    in_flight: int = 0  # traces admitted on probation, not yet ended


@dataclass(frozen=True)
class Refusal:
    """Why a tenant's trace is refused now, and when to come back."""

    detail: str
    retry_after_s: float

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class TenantBook:
    """Per-tenant cool-downs after stopped blocks, for one application.

    Args:
        penalty: ``runaway_penalty``; 0 turns the book off.
        clock: seconds, monotonic (injected by tests).
    """

    def __init__(self, penalty: float, clock: Any = time.monotonic) -> None:
        self.penalty = penalty
        self.clock = clock
        self.book: dict[str, Standing] = {}

    def cooling_s(self, tenant: str) -> float:
        """Seconds left of ``tenant``'s cool-down (0 when none): for operators and tests."""
        standing = self.book.get(tenant)
        return max(0.0, standing.refused_until - self.clock()) if standing is not None else 0.0

    def admit(self, tenant: str | None) -> tuple[Refusal | None, bool]:
        """``(refusal, tracked)``: a refusal to send back, or None and whether ``end`` must be told of the trace."""
        standing = self.book.get(tenant) if tenant is not None and self.penalty > 0 else None
        if standing is None:
            return None, False
        now = self.clock()
        left = standing.refused_until - now
        if left > 0:
            return Refusal(
                f"tenant {tenant!r}: {standing.stops} of your intervention blocks were stopped at their deadline, "
                f"holding an engine {standing.held_s:.1f} s in all while every other request on it waited; new "
                f"traces from you are refused for {left:.1f} s more (runaway_penalty={self.penalty:g} x the time a "
                f"stopped block held the engine). Make the block give the model its thread back (no endless loop or "
                f"long sleep), or ask for more time per trace with block_timeout_s=...", left), False
        if now - standing.last_stop >= PROBATION_S:
            return None, False
        if standing.in_flight >= 1:
            return Refusal(
                f"tenant {tenant!r}: one trace at a time for {PROBATION_S - (now - standing.last_stop):.0f} s more, "
                f"since a block of yours was stopped at its deadline; send the next when this one has ended", 1.0), False
        standing.in_flight += 1
        return None, True

    def end(self, tenant: str | None, error: dict | None, tracked: bool = False) -> float:
        """A trace ended; if its block was stopped, start or extend the tenant's cool-down (the seconds added)."""
        standing = self.book.get(tenant) if tenant is not None else None
        if tracked and standing is not None:
            standing.in_flight = max(0, standing.in_flight - 1)
        held = held_seconds(error)
        if held is None or tenant is None or self.penalty <= 0:
            return 0.0
        standing = self.book.setdefault(tenant, Standing())
        added = self.penalty * held
        now = self.clock()
        standing.refused_until = max(standing.refused_until, now) + added
        standing.stops += 1
        standing.held_s += held
        standing.last_stop = now
        return added
