"""The application's job book as a Serve deployment, and the replicas' client of it (Ray edges only).

``NNsightJobs`` is one replica per application (deleted with it), a thin shell
over ``jobs.JobBook`` and ``tenants.TenantBook`` (a tenant's cool-down holds on
every replica, not only the one whose engine stopped its block): every replica's ``remote=True`` routes read and write
jobs through it, so a websocket on one replica hears of a job that runs on
another. It sweeps the book each second (deadlines, TTLs). If its process dies,
Serve restarts it empty: jobs in flight then end in ERROR on their replicas
("no job" when they report), and open subscriptions end.

``JobsClient`` is what a replica holds: the book's methods as coroutines over
the deployment's handle, raising the book's own exceptions (``UnknownSession``)
rather than Ray's wrapping of them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from ..errors import held_seconds
from .jobs import JobBook, JobLimits
from .tenants import Refusal, TenantBook

__all__ = ["JobsClient", "NNsightJobs", "TenantsClient"]

logger = logging.getLogger(__name__)

SWEEP_EVERY_S = 1.0


@serve.deployment(name="NNsightJobs", num_replicas=1, max_ongoing_requests=10000,
                  ray_actor_options={"num_cpus": 0})
class NNsightJobs:
    """One ``JobBook`` for the application; method calls arrive over its handle."""

    def __init__(self, limits: JobLimits, runaway_penalty: float = 0.0) -> None:
        self.book = JobBook(limits)
        self.tenants = TenantBook(runaway_penalty)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            try:
                self.book.sweep()
            except Exception:  # a loop that dies silently would leave jobs unended
                logger.exception("NNsightJobs: sweep failed")

    async def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.book, method)(*args)
        return await result if asyncio.iscoroutine(result) else result

    async def tenant(self, method: str, *args: Any) -> Any:
        return getattr(self.tenants, method)(*args)


class TenantsClient:
    """The application's ``TenantBook`` (cool-downs after stopped blocks), from a replica.

    With the penalty off (``on`` false: tenants not told apart) nothing crosses
    to the book; with it on, a trace costs one call to admit it, and one more
    at its end when its block was stopped or its tenant is on probation. Should the book be unreachable the
    trace goes on (it fails open: the deadlines still hold every block).
    """

    def __init__(self, handle: Any, on: bool) -> None:
        self.handle, self.on = handle, on

    async def admit(self, tenant: str | None) -> tuple[Refusal | None, bool]:
        if not self.on or tenant is None:
            return None, False
        try:
            return await self.handle.tenant.remote("admit", tenant)
        except Exception:
            logger.warning("tenant book unreachable; %s's trace goes on", tenant, exc_info=True)
            return None, False

    async def end(self, tenant: str | None, error: dict | None, tracked: bool) -> None:
        if self.on and tenant is not None and (tracked or held_seconds(error) is not None):
            try:
                await self.handle.tenant.remote("end", tenant, error, tracked)
            except Exception:
                logger.warning("tenant book unreachable; the end of %s's trace is not recorded", tenant,
                               exc_info=True)


class JobsClient:
    """``await client.<JobBook method>(...)`` from a replica, over the ``NNsightJobs`` handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)

        async def call(*args: Any) -> Any:
            from .._internal.cluster.ray_errors import cause

            try:
                return await self.handle.call.remote(method, *args)
            except Exception as error:
                raise cause(error) from None

        return call
