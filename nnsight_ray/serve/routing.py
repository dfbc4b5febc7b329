"""Serve's request router for nnsight replicas: new requests go past an engine that has stopped stepping.

A block that holds the model's thread (until its deadline stops it) stalls
every request of its replica's engine; Serve's default router (power of two
choices on queue length) does not see that, so a replica whose engine is
stalled keeps getting its share of new requests while another sits idle.

Each replica reports, through Serve's routing-stats seam
(``record_routing_stats``, polled every ``ROUTING_STATS_PERIOD_S``), how long
its engine has gone without finishing a step while it has work
(``nnsight_stalled_s``, from the engine's step clock,
``_internal/observe/progress.py``). A replica whose engine failed,
died or does not answer reports ``NEVER``. ``StallAwareRouter`` ranks the replicas
stalled for ``stalled_after_s`` or more last: a request goes to one of them
only when every other replica refuses it (full). Among the moving ones it is
Serve's power of two choices, as by default. Stats are a poll old, so a stall
is routed around from about ``stalled_after_s`` plus one period after it began.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter

__all__ = ["NEVER", "ROUTING_STATS_PERIOD_S", "STALLED_KEY", "StallAwareRouter", "router_config", "routing_stats"]

STALLED_KEY = "nnsight_stalled_s"
NEVER = 1e9  # what a replica whose engine failed, died or does not answer reports: it goes last
ROUTING_STATS_PERIOD_S = 0.5
ROUTING_STATS_TIMEOUT_S = 2.0


def split(replicas: list, stalled_after_s: float) -> tuple[list, list]:
    """(moving, stalled): a replica with no stats yet counts as moving."""
    moving, stalled = [], []
    for replica in replicas:
        stats = replica.routing_stats or {}
        (stalled if float(stats.get(STALLED_KEY, 0.0)) >= stalled_after_s else moving).append(replica)
    return moving, stalled


class StallAwareRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Power of two choices among replicas whose engines are stepping; stalled ones last."""

    def initialize_state(self, stalled_after_s: float = 2.0, **kwargs: Any) -> None:
        self.stalled_after_s = float(stalled_after_s)

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list[list]:
        moving, stalled = split(candidate_replicas, getattr(self, "stalled_after_s", 2.0))
        return [random.sample(group, min(2, len(group))) for group in (moving, stalled) if group]


async def routing_stats(state: str, engine: Any) -> dict[str, float]:
    """A replica's routing stats: its engine actor's stall (``load``), ``NEVER`` once it failed, died or is gone."""
    if state == "starting":
        return {}
    try:
        load = await engine.load.remote()
    except Exception:  # the engine actor is gone: route past this replica until Serve replaces it
        load = {"dead": True}
    return {STALLED_KEY: NEVER if load.get("dead") or state != "ready" else float(load["stalled_s"])}


def router_config(stalled_after_s: float) -> Any:
    """The deployment's ``request_router_config``: this router, polling every replica's stall twice a second."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=StallAwareRouter,
                               request_router_kwargs={"stalled_after_s": stalled_after_s},
                               request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                               request_routing_stats_timeout_s=ROUTING_STATS_TIMEOUT_S)
