"""Waiting for the project's series on Ray's metrics export ports (docs/metrics.md), for the integration tests."""

from __future__ import annotations

import time
from typing import Callable

from nnsight_ray._internal.observe.metrics import export_ports, exported_samples as scrape, sample_sum as total

__all__ = ["export_ports", "scrape", "total", "wait_for_moves"]


def wait_for_moves(ports, before, wanted: dict[str, tuple[Callable, float]], seconds: float = 60) -> dict[str, float]:
    """Poll the ports until each ``wanted[what] = (value of samples, at least)`` grew by at least that much since
    ``before`` (Ray flushes every few seconds); returns each growth seen last."""
    deadline = time.monotonic() + seconds
    while True:
        now = scrape(ports)
        grown = {what: value(now) - value(before) for what, (value, _) in wanted.items()}
        if all(grown[what] >= least for what, (_, least) in wanted.items()) or time.monotonic() > deadline:
            return grown
        time.sleep(2)
