"""The application's job book as a Serve deployment, and the replicas' client of it (Ray edges only).

``NNsightJobs`` is one replica per application (deleted with it), a thin shell
over ``jobs.JobBook``: every replica's ``remote=True`` routes read and write
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

from .jobs import JobBook, JobLimits

__all__ = ["JobsClient", "NNsightJobs"]

logger = logging.getLogger(__name__)

SWEEP_EVERY_S = 1.0


@serve.deployment(name="NNsightJobs", num_replicas=1, max_ongoing_requests=10000,
                  ray_actor_options={"num_cpus": 0})
class NNsightJobs:
    """One ``JobBook`` for the application; method calls arrive over its handle."""

    def __init__(self, limits: JobLimits) -> None:
        self.book = JobBook(limits)
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
