"""Whether an engine is making progress: how long it has gone without finishing a step while it has work.

A block that holds the model's thread (a runaway, a long ``time.sleep``, a
long torch op) stops every step of its engine until its deadline stops it.
Serve's router should send new requests to another replica meanwhile
(``serve/routing.py``); for that it needs, per engine, "work in flight and no
step finished for N seconds".

The step clock is vLLM's own seam: a stat logger (``StatLoggerBase``, passed as
``AsyncLLM(stat_loggers=...)``) whose ``record`` vLLM's output handler calls
once per engine step, on the engine actor's event loop. Recording is one
``time.monotonic()``. It is installed only where vLLM logs its stats anyway (a
served engine: ``usage_context="OPENAI_API_SERVER"``, as ``vllm serve``); an
offline engine keeps vLLM's per-step stats off (as ``vllm.LLM`` does) and
reports no stall. The engine core says when work arrives on an idle
engine (``busy``), so the first step of a new request is not mistaken for a
stall that began when the engine last stepped.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Progress"]


class Progress:
    """When the engine last finished a step, and since when it has had work waiting on one."""

    def __init__(self, ticking: bool = False, clock: Any = time.monotonic) -> None:
        # Ticking only where vLLM logs stats anyway (a served engine, as `vllm serve`): a stat logger would
        # turn vLLM's per-step stats on for an offline engine, which keeps them off (as vllm.LLM does).
        self.ticking = ticking
        self.clock = clock
        self.last_step = clock()
        self.busy_since = self.last_step

    def step(self) -> None:
        self.last_step = self.clock()

    def busy(self, was_idle: bool) -> None:
        """Work arrived; if the engine had none, the wait for its next step starts now."""
        if was_idle:
            self.busy_since = self.clock()

    def stalled_s(self, in_flight: int) -> float:
        """Seconds without a finished step while ``in_flight`` requests wait; 0 for an idle engine or no clock."""
        if in_flight <= 0 or not self.ticking:
            return 0.0
        return max(0.0, self.clock() - max(self.last_step, self.busy_since))

    def stat_loggers(self) -> list[Any] | None:
        """``AsyncLLM(stat_loggers=...)`` for this engine: None where vLLM's stats are off; else this clock and
        vLLM's own Prometheus logger on Ray's metrics (``RayPrometheusStatLogger``, what Ray Data LLM and Ray
        Serve LLM install), so vLLM's series reach Ray's export port. It takes the place of the
        ``PrometheusStatLogger`` vLLM would add into this process's registry, which nothing scrapes."""
        if not self.ticking:
            return None
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        return [self.stat_logger(), RayPrometheusStatLogger]

    def stat_logger(self) -> Any:
        """A vLLM stat-logger factory whose loggers tick this clock on every step."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        progress = self

        class StepClock(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                progress.step()

            def log_engine_initialized(self) -> None:
                pass

        return StepClock
