"""Every metric the project exports, defined once, recorded through ``ray.util.metrics``.

Ray exports what a process records on its node's metrics export port
(``ray.nodes()[i]["MetricsExportPort"]``, Prometheus text), so Ray's
Prometheus scrape config and its Grafana dashboards see these series as
``ray_<name>`` (counters ``ray_<name>_total``; histograms ``_bucket``, ``_sum``,
``_count``) beside Ray's own, with Ray's tags (``NodeAddress``, ``WorkerId``,
``SessionName``) added. ``docs/metrics.md`` lists each with a PromQL query.

Recording never fails a request and never needs a cluster: outside a
connected Ray worker (unit tests, a plain Python process) every call is a
no-op, and a backend can be swapped in (``use_backend``) to see the calls.
Metric objects are made once per process, on first use.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

logger = logging.getLogger(__name__)

__all__ = ["METRICS", "Metric", "export_ports", "exported_names", "exported_samples", "in_flight", "inc", "observe",
           "sample_sum", "set_gauge", "use_backend"]

LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
COLLECT_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


@dataclass(frozen=True)
class Metric:
    """One exported metric: Ray's name (without Ray's ``ray_`` prefix), kind, tags."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    tags: tuple[str, ...]
    boundaries: tuple[float, ...] = ()


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("nnsight_requests_in_flight", "gauge",
           "Requests a Serve replica is serving now: kind=traced (nnsight traces) or plain (OpenAI routes).",
           ("route", "kind", "replica")),
    Metric("nnsight_request_latency_seconds", "histogram",
           "Seconds from a request's arrival at a Serve replica to its last byte (a stream's end); "
           "status=ok (HTTP < 400), rejected (4xx), error (5xx or raised), cancelled (the client left).",
           ("route", "kind", "status"), tuple(LATENCY_BOUNDARIES)),
    Metric("nnsight_time_to_first_token_seconds", "histogram",
           "Seconds from a streamed request's arrival to its first generated token.",
           ("route",), tuple(LATENCY_BOUNDARIES)),
    Metric("nnsight_saved_bytes", "counter",
           "Bytes of saved values sent back to clients (a trace's reply, nnsight_saves).",
           ("route",)),
    Metric("nnsight_collect_seconds", "histogram",
           "Seconds per collection batch: stage=stash (the engine loop's collective_rpc, no step runs meanwhile), "
           "stage=merge (a merge actor taking every rank's payloads and merging them).",
           ("stage",), tuple(COLLECT_BOUNDARIES)),
    Metric("nnsight_intervention_errors", "counter",
           "Requests whose intervention (trace or registered edit) raised, by exception type.",
           ("route", "type")),
    Metric("nnsight_data_rows", "counter",
           "Rows a Ray Data engine stage (nnsight_ray.data) finished: outcome=ok, or failed with the error's type "
           "(the row's __inference_error__: an intervention that raised, a prompt vLLM refused, ...).",
           ("engine", "outcome", "type")),
    Metric("nnsight_data_batch_seconds", "histogram",
           "Seconds a Ray Data engine stage's batch spent, by phase: queued (arrived on the actor, waiting for a "
           "max_concurrent_batches slot and its engine's tracing thread), build (its trace built and sent on that "
           "thread; an engine in the actor runs the whole trace here), engine (sent -> values and outputs back on "
           "the actor), rows (the output rows built), total (arrival -> rows).",
           ("engine", "phase"), tuple(LATENCY_BOUNDARIES)),
    Metric("nnsight_data_batches_in_flight", "gauge",
           "Batches a Ray Data engine stage's actor has on an engine now (at most max_concurrent_batches).",
           ("engine",)),
    Metric("nnsight_engine_deaths", "counter",
           "Engine deployments found dead (a rank, merge actor, engine actor or vLLM engine core died).",
           ("deployment",)),
)}


def exported_names(name: str) -> list[str]:
    """The Prometheus series names Ray exports for ``name``."""
    kind = METRICS[name].kind
    base = f"ray_{name}"
    if kind == "counter":
        return [f"{base}_total"]
    if kind == "histogram":
        return [f"{base}_bucket", f"{base}_sum", f"{base}_count"]
    return [base]


def export_ports() -> list[int]:
    """Every live raylet's metrics export port (``ray.nodes()``; Ray connected)."""
    import ray

    return sorted({n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]})


# The series of this project and of the vLLM engines it runs (``Progress.stat_loggers``), as Ray exports them.
EXPORTED_PREFIXES = ("ray_nnsight_", "ray_vllm_")


def exported_samples(ports: list[int] | None = None) -> list[tuple[str, dict[str, str], float]]:
    """Every ``ray_nnsight_*`` and ``ray_vllm_*`` sample the export ports show now: ``(name, labels, value)``
    (default: every live raylet's port). What Prometheus would scrape, for a check or a benchmark without one."""
    import re
    import urllib.request

    samples = []
    for port in export_ports() if ports is None else ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if not line.startswith(EXPORTED_PREFIXES):
                continue
            head, _, value = line.rpartition(" ")
            name, _, labels = head.partition("{")
            samples.append((name, dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)), float(value)))
    return samples


def sample_sum(samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for n, got, v in samples if n == name and all(got.get(k) == w for k, w in labels.items()))


class Backend(Protocol):
    def record(self, metric: Metric, value: float, tags: dict[str, str]) -> None: ...


class RayBackend:
    """``ray.util.metrics`` objects, made on first use in each process; a no-op outside a Ray worker."""

    def __init__(self) -> None:
        self._objects: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _object(self, metric: Metric) -> Any:
        with self._lock:
            made = self._objects.get(metric.name)
            if made is None:
                from ray.util import metrics as ray_metrics

                if metric.kind == "counter":
                    made = ray_metrics.Counter(metric.name, metric.description, tag_keys=metric.tags)
                elif metric.kind == "gauge":
                    made = ray_metrics.Gauge(metric.name, metric.description, tag_keys=metric.tags)
                else:
                    made = ray_metrics.Histogram(metric.name, metric.description, list(metric.boundaries),
                                                 tag_keys=metric.tags)
                self._objects[metric.name] = made
            return made

    def record(self, metric: Metric, value: float, tags: dict[str, str]) -> None:
        import ray

        if not ray.is_initialized():
            return
        made = self._object(metric)
        if metric.kind == "counter":
            made.inc(value, tags=tags)
        elif metric.kind == "gauge":
            made.set(value, tags=tags)
        else:
            made.observe(value, tags=tags)


_backend: Backend = RayBackend()


def use_backend(backend: Backend | None) -> Backend:
    """Record through ``backend`` from now on (``None``: Ray's again); returns the previous one."""
    global _backend
    previous, _backend = _backend, backend or RayBackend()
    return previous


def _record(name: str, value: float, tags: dict[str, Any]) -> None:
    metric = METRICS[name]
    if set(tags) != set(metric.tags):
        raise ValueError(f"metric {name} takes tags {metric.tags}, given {sorted(tags)}")
    try:
        _backend.record(metric, float(value), {k: str(v) for k, v in tags.items()})
    except Exception:  # a metric never fails the request it describes
        logger.debug("recording %s failed", name, exc_info=True)


def inc(name: str, value: float = 1.0, **tags: Any) -> None:
    """Add ``value`` to the counter ``name``."""
    _record(name, value, tags)


def observe(name: str, value: float, **tags: Any) -> None:
    """One observation of the histogram ``name``."""
    _record(name, value, tags)


def set_gauge(name: str, value: float, **tags: Any) -> None:
    _record(name, value, tags)


_flight: dict[tuple, int] = {}
_flight_lock = threading.Lock()


@contextmanager
def in_flight(route: str, kind: str, replica: str) -> Iterator[dict[str, Any]]:
    """Count a request in ``nnsight_requests_in_flight`` while it runs; record its latency at the end.

    Yields a dict whose ``"status"`` tags the latency observation: ``"ok"``
    unless set (see ``http_status``), ``"error"`` if the block raised,
    ``"cancelled"`` if it was cancelled or closed (a client that left a stream).
    """
    import asyncio

    key = (route, kind, replica)
    began = time.perf_counter()
    outcome: dict[str, Any] = {"status": "ok"}
    with _flight_lock:
        _flight[key] = _flight.get(key, 0) + 1
        now = _flight[key]
    set_gauge("nnsight_requests_in_flight", now, route=route, kind=kind, replica=replica)
    try:
        yield outcome
    except (asyncio.CancelledError, GeneratorExit):
        outcome["status"] = "cancelled"
        raise
    except BaseException:
        outcome["status"] = "error"
        raise
    finally:
        with _flight_lock:
            _flight[key] -= 1
            now = _flight[key]
        set_gauge("nnsight_requests_in_flight", now, route=route, kind=kind, replica=replica)
        observe("nnsight_request_latency_seconds", time.perf_counter() - began,
                route=route, kind=kind, status=outcome["status"])


def http_status(code: int) -> str:
    """The latency histogram's ``status`` for an HTTP status code."""
    return "ok" if code < 400 else "rejected" if code < 500 else "error"
