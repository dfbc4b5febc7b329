"""The engine stage: a stateful ``map_batches`` UDF that runs each batch as one nnsight trace.

``NNsightEngineStage`` is a Ray Data LLM ``StatefulStage``; Ray Data runs its
UDF on an actor pool (``compute=ActorPoolStrategy``, ``concurrency`` as Ray
Data LLM defines it). Each actor holds one engine: a ``LocalVLLM`` at TP x PP
= 1, a ``RayVLLM`` above (and for an activation dataset at any layout), whose
rank actors take the bundles of the placement group the actor runs in
(``placement``). It is built on the actor's
one tracing thread, which every trace is then built on (one tracing thread per
client object); the actor's event loop stays free. A ``RayVLLM``'s traces are
sent without waiting (``blocking=False``) and waited for on a pool of
``max_concurrent_batches`` threads, so that many batches are in flight on the
engine at once; a ``LocalVLLM``'s run to the end on the tracing thread. When Ray Data lets the
actor go, the engine is shut down (and, for a ``RayVLLM``, the actor's group
removed: ``placement.stop_engine``).

Connected (``engine_names``): the actor starts no engine; it attaches to
each named ``RayVLLM`` deployment (``RayVLLM.connect``, each client built
on a tracing thread of its own) and runs each batch on the one with the
fewest of its batches in flight. Those engines are the deployments' owners'
to stop: the actor leaves them running when it goes.

Per batch: one trace with one invoke per row (the row's prompt and its own
sampling parameters), each invoke running the config's saves
(``batch.interventions.read_saves``) or the user's ``intervene``, then reading
the request's output (``tracer.result``) for the generated tokens and text.

An activation dataset (``activations``) runs each batch as plain requests
instead (``extract_batch``): one ``extract_async`` of the batch's prompts
under a part name of its own (a uuid: a retried batch never overwrites a
committed file), its outputs awaited, then ``extract_commit``: the engine's
writing ranks write the part's token rows into ``activations.dir``. Each row
then names its files, its ``prompt_index`` in them and its row count. These
batches wait on a pool of threads of their own (the tracing thread only
submits), so ``max_concurrent_batches`` parts are in flight on an actor.

A failure: a trace of several rows that fails is run again one row per trace,
so the failing row is found and every other row keeps its values; a single row's failure is that
row's ``__inference_error__`` (``"<Type>: <message>"``) when
``should_continue_on_error``, else the batch (and the run) fails with it. An
engine that died (vLLM's ``EngineDeadError``) ends the actor, as Ray Data
LLM's vLLM stage does, so Ray Data restarts it and retries the batch on a
live engine.

Metrics (``docs/metrics.md``): rows by outcome and error type, each batch's
phases (queued, build, engine, rows, total) and the batches in flight, per
engine, through ``ray.util.metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from ray.llm._internal.batch.stages.base import StatefulStage, StatefulStageUDF

from .._internal.observe import metrics
from .columns import (ACTIVATION_COLUMNS, activation_row, describe_error, failure_row, many_columns, request,
                      success_row)

logger = logging.getLogger(__name__)

__all__ = ["EXTRACT_SAMPLING", "NNsightEngineStage", "NNsightEngineStageUDF", "extract_sampling", "run_trace",
           "trace_rows"]

#: The sampling fields an activation dataset's requests take (``RayVLLM.extract_async``), with their defaults.
EXTRACT_SAMPLING = {"max_tokens": 1, "temperature": 0.0}


def run_trace(model: Any, fn: Callable, requests: Sequence[tuple[Any, dict[str, Any]]],
              blocking: bool = True, slots: bool = False) -> Any:
    """One trace, one invoke per ``(prompt, sampling)``: each invoke's ``(values, prompt ids, generated ids, text)``.

    Blocking (a ``LocalVLLM``), ``rows`` is bound and saved above the invokes,
    so each request's copy carries its own slot and nnsight merges them
    slot-wise, and each invoke reads its request's output from
    ``tracer.result``. ``blocking=False`` (a ``RayVLLM``): returns the tracer
    once the requests are sent, and ``trace_rows(tracer)`` waits for the
    values and the requests' outputs (``trace(outputs=True)``), so no block is
    held open on a rank until its request ends. There each invoke saves its own
    ``values`` and nnsight's collection hands them back as a list in request
    order (one per request): every invoke's block then reads the same objects
    (``fn``, ``model``, ``tracer``), so the trace's attach pickles that state
    once for all of them (``_internal/blocks/shared_blocks.py``), where a slot
    index ``i`` in the block made it pickle one state per invoke (2.9x the
    build on the CPU, ``python -m benchmarks.stage_build``). A request sampling ``n > 1``
    sequences saves once per sequence, so those traces keep the slots
    (``slots=True``: always, for comparison).
    """
    import nnsight

    if not blocking and not slots and all(int(sampling.get("n") or 1) == 1 for _, sampling in requests):
        with model.trace(blocking=False, outputs=True) as tracer:
            for prompt, sampling in requests:
                with tracer.invoke(prompt, **sampling):
                    values = nnsight.save(fn(model, tracer))  # noqa: F841 - collected by name
        return tracer
    with model.trace(**({} if blocking else {"blocking": False, "outputs": True})) as tracer:
        rows = nnsight.save([None] * len(requests))
        for i, (prompt, sampling) in enumerate(requests):
            with tracer.invoke(prompt, **sampling):
                values = fn(model, tracer)
                if blocking:
                    result = tracer.result
                    rows[i] = (values, list(result.prompt_token_ids), list(result.outputs[0].token_ids),
                               result.outputs[0].text)
                else:
                    rows[i] = values
    return list(rows) if blocking else tracer


def trace_rows(tracer: Any) -> list[tuple]:
    """A non-blocking ``run_trace``'s rows once its requests are done: ``(values, prompt ids, generated ids, text)``."""
    saves, outputs = tracer.collect()
    if "rows" in saves:  # the slots of a trace with n > 1 (or slots=True)
        found = saves["rows"]
    else:  # one saved ``values`` per request: nnsight's collection lists them in request order, or one alone
        found = saves["values"] if len(outputs) > 1 else [saves["values"]]
    return [(values, out["prompt_token_ids"], out["token_ids"], out["text"]) for values, out in zip(found, outputs)]


def _timed(fn: Callable, *args: Any) -> tuple[float, float, Any]:
    """``fn(*args)`` with the ``perf_counter`` it started and ended at (on the thread it ran on)."""
    started = time.perf_counter()
    value = fn(*args)
    return started, time.perf_counter(), value


def extract_sampling(sampling: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A row's ``sampling_params`` as an activation request takes them (``EXTRACT_SAMPLING``), as a hashable key.

    Any other field is refused (``ValueError``: the row's error) rather than ignored.
    """
    other = sorted(set(sampling) - set(EXTRACT_SAMPLING))
    if other:
        raise ValueError(f"sampling_params {other}: an activation dataset's requests take only "
                         f"{sorted(EXTRACT_SAMPLING)}")
    return tuple((key, sampling.get(key, default)) for key, default in EXTRACT_SAMPLING.items())


def is_fatal(error: BaseException) -> bool:
    """The engine (not the request) failed: the actor must go."""
    import ray
    from ray.llm._internal.common.errors import VLLM_FATAL_ERRORS

    from ..errors import NNsightRayError

    if isinstance(error, VLLM_FATAL_ERRORS):
        return True
    if isinstance(error, NNsightRayError) and not error.recoverable:
        return True  # the engine is gone (EngineDeadError), not just this request
    # object lost, owner died, actor died; a task's own error is the request's
    return isinstance(error, ray.exceptions.RayError) and not isinstance(error, ray.exceptions.RayTaskError)


def collect_commits(commits: list[Any], part: str) -> list[dict[str, Any]] | BaseException:
    """What each writing rank wrote of ``part``: ``{"file", "rows", "bytes", "prompts"}``; the error if one failed."""
    import ray

    from .._internal.cluster.ray_errors import get as ray_get

    try:
        return [w for w in ray_get(commits) if w is not None]
    except Exception as error:  # a rank died while writing
        return error if isinstance(error, ray.exceptions.RayError) else RuntimeError(f"writing {part}: {error}")


def part_rows(written: list[dict[str, Any]], indices: Sequence[int]) -> tuple[list[str], list[int | None]]:
    """A committed part's file names (one per pipeline stage that wrote one) and each prompt's token rows in them.

    A prompt's count is None when the writing ranks do not all hold the same rows of it (vLLM never ran it whole).
    """
    from pathlib import Path

    files = [Path(w["file"]).name for w in written if w.get("file")]
    counts: list[int | None] = []
    for index in indices:
        seen = {w["prompts"].get(index) for w in written}
        counts.append(seen.pop() if len(seen) == 1 and None not in seen else None)
    return files, counts


@dataclass
class Engine:
    """One engine of an actor: the client, the thread every trace on it runs on (the one that built it), what each
    invoke calls, whether the actor started it (and so stops it), and the actor's batches on it now; ``name`` tags
    its metrics (a deployment's name; ``in-actor`` for an engine in the actor)."""

    model: Any
    thread: ThreadPoolExecutor
    fn: Callable | None
    owned: bool
    in_flight: int = 0
    name: str = "in-actor"

    @property
    def sends(self) -> bool:
        """Whether its traces can be sent without waiting (a ``RayVLLM``: ``trace(blocking=False)``), so several
        of the actor's batches are in flight on it at once; else each holds its thread to the end."""
        return type(self.model).__name__ == "RayVLLM"


def same_model(served: Any, model_source: str) -> bool:
    """Whether a connected deployment's model is ``model_source`` (paths compared resolved)."""
    from pathlib import Path

    if served == model_source:
        return True
    try:
        return Path(str(served)).expanduser().resolve() == Path(model_source).expanduser().resolve()
    except (OSError, ValueError):
        return False


class NNsightEngineStageUDF(StatefulStageUDF):
    """One engine per actor (or connected engines); a batch of rows -> one trace -> the rows' columns."""

    def __init__(self, data_column: str, expected_input_keys: list[str], model_source: str,
                 engine_kwargs: dict[str, Any], saves: list[dict[str, Any]] | None, intervene: Callable | None,
                 should_continue_on_error: bool = False, placement: dict[str, Any] | None = None,
                 activations: dict[str, Any] | None = None, max_concurrent_batches: int = 1,
                 engine_names: list[str] | None = None) -> None:
        super().__init__(data_column, expected_input_keys)
        self.should_continue_on_error = should_continue_on_error
        self.activations = activations
        self.names = list(ACTIVATION_COLUMNS) if activations else [spec["location"] for spec in saves or []]
        # Batches wait here, several at once: for their traces' values, or their outputs and commits.
        self._waits = ThreadPoolExecutor(max_workers=max(1, max_concurrent_batches), thread_name_prefix="nnsight-wait")
        self._lock = threading.Lock()
        self.engines: list[Engine] = []
        names = list(engine_names or [None])
        random.shuffle(names)  # actors of one pool break ties between idle engines differently
        for name in names:
            # Every trace on an engine runs on its one thread, the one that built its client.
            thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nnsight-data")
            try:
                model, fn = thread.submit(self._start, model_source, engine_kwargs, saves, intervene,
                                          placement, name).result()
            except BaseException:
                thread.shutdown(wait=False)
                raise
            self.engines.append(Engine(model, thread, fn, owned=name is None,
                                       name=name or getattr(model, "name", None) or "in-actor"))

    @staticmethod
    def _start(model_source: str, engine_kwargs: dict[str, Any], saves: list[dict[str, Any]] | None,
               intervene: Callable | None, placement: dict[str, Any] | None = None,
               name: str | None = None) -> tuple[Any, Callable]:
        from ..batch.config import SaveSpec
        from ..batch.interventions import reader, resolve_saves
        from ..local import LocalVLLM
        from .placement import start_engine

        started = time.monotonic()
        if name is not None:  # a running deployment: attach only
            from ..ray_vllm import RayVLLM

            model = RayVLLM.connect(name)
            served = model.model_path
            if not same_model(served, model_source):
                raise ValueError(f"engine {name!r} serves {served!r}, not model_source {model_source!r}; "
                                 "give the model it serves")
        elif placement is not None:  # rank actors: ranks in this actor's placement group
            model = start_engine(model_source, engine_kwargs, placement)
        else:
            model = LocalVLLM(model_source, dispatch=True, **engine_kwargs)
        logger.info("nnsight engine %s for %s ready in %.1f s", name or "(this actor's)", model_source,
                    time.monotonic() - started)
        if intervene is not None or saves is None:  # an intervention, or an activation dataset (no trace)
            return model, intervene
        return model, reader(resolve_saves(model._module, [SaveSpec(**spec) for spec in saves or []]))

    @property
    def model(self) -> Any:
        """The first engine's client (the only one unless connected to several)."""
        return self.engines[0].model

    def _acquire(self) -> Engine:
        with self._lock:
            engine = min(self.engines, key=lambda e: e.in_flight)
            engine.in_flight += 1
            now = engine.in_flight
        metrics.set_gauge("nnsight_data_batches_in_flight", now, engine=engine.name)
        return engine

    async def udf(self, batch: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        arrived = time.perf_counter()
        engine = self._acquire()
        try:
            work = self.extract_batch if self.activations else self.run_batch
            rows = await loop.run_in_executor(self._waits, work, batch, engine, arrived)
        finally:
            with self._lock:
                engine.in_flight -= 1
                now = engine.in_flight
            metrics.set_gauge("nnsight_data_batches_in_flight", now, engine=engine.name)
        metrics.observe("nnsight_data_batch_seconds", time.perf_counter() - arrived, engine=engine.name, phase="total")
        for row in rows:
            yield row

    # -- on a waiting thread; traces are built on the engine's tracing thread ---

    def _trace(self, engine: Engine, requests: list[tuple[Any, dict[str, Any]]],
               arrived: float | None = None) -> list[tuple]:
        """The requests as one trace on ``engine``; with ``arrived`` (the batch's arrival on the actor), its
        ``queued``, ``build`` and ``engine`` phases are recorded."""
        started = built = None
        try:
            if engine.sends:  # sent from the tracing thread, waited for here: the thread is free for the next batch
                started, built, tracer = engine.thread.submit(_timed, run_trace, engine.model, engine.fn, requests,
                                                              False).result()
                return trace_rows(tracer)
            started, built, rows = engine.thread.submit(_timed, run_trace, engine.model, engine.fn, requests).result()
            return rows
        finally:  # a trace that failed once sent (an intervention on the ranks) has its phases too
            if arrived is not None and started is not None:
                for phase, seconds in (("queued", started - arrived), ("build", built - started),
                                       ("engine", time.perf_counter() - built)):
                    metrics.observe("nnsight_data_batch_seconds", seconds, engine=engine.name, phase=phase)

    def run_batch(self, batch: list[dict[str, Any]], engine: Engine | None = None,
                  arrived: float | None = None) -> list[dict[str, Any]]:
        engine = engine or self.engines[0]
        batch_uuid = uuid.uuid4().hex
        out: list[dict[str, Any]] = []
        todo: list[tuple[Any, Any, dict[str, Any]]] = []
        for row in batch:
            idx = row[self.IDX_IN_BATCH_COLUMN]
            try:
                todo.append((idx, *request(row)))
            except Exception as error:
                out.append(self._failed(idx, error, batch_uuid, engine))
        if not todo:
            return out
        started = time.perf_counter()
        try:
            results = self._trace(engine, [(prompt, sampling) for _, prompt, sampling in todo], arrived)
        except Exception as error:
            self._check(error)
            # The failing row is found by running each alone.
            results = [error] if len(todo) == 1 else [self._alone(engine, prompt, sampling)
                                                      for _, prompt, sampling in todo]
        finished = time.perf_counter()
        seconds = finished - started
        done = 0
        # The batch's saved values to the host at once: a few torch calls, not a few per row (``host_arrays``).
        made = iter(many_columns([result[0] for result in results if not isinstance(result, BaseException)]))
        for (idx, _, sampling), result in zip(todo, results):
            columns = result if isinstance(result, BaseException) else next(made)
            if isinstance(columns, BaseException):  # the row's error, or intervene() named a stage column
                out.append(self._failed(idx, columns, batch_uuid, engine))
                continue
            _, prompt_ids, generated, text = result
            out.append(success_row(idx, columns, prompt_ids, generated, text, batch_uuid, seconds, sampling))
            done += 1
        self._done(engine, done, finished, arrived)
        return out

    @staticmethod
    def _done(engine: Engine, rows: int, finished: float, arrived: float | None) -> None:
        """The batch's ``rows`` phase (results -> rows) and its rows that succeeded."""
        if arrived is not None:
            metrics.observe("nnsight_data_batch_seconds", time.perf_counter() - finished, engine=engine.name,
                            phase="rows")
        if rows:
            metrics.inc("nnsight_data_rows", rows, engine=engine.name, outcome="ok", type="")

    def _alone(self, engine: Engine, prompt: Any, sampling: dict[str, Any]) -> Any:
        try:
            return self._trace(engine, [(prompt, sampling)])[0]
        except Exception as error:
            self._check(error)
            return error

    # -- activation datasets: on a waiting thread ------------------------------

    def extract_batch(self, batch: list[dict[str, Any]], engine: Engine | None = None,
                      arrived: float | None = None) -> list[dict[str, Any]]:
        """The batch as one part of the activation dataset (one per distinct sampling); a row per input row.
        Its metrics: the rows, and the whole batch as ``total`` (``udf``); no other phase."""
        engine = engine or self.engines[0]
        batch_uuid = uuid.uuid4().hex
        out: list[dict[str, Any]] = []
        groups: dict[tuple, list[tuple[Any, Any]]] = {}
        for row in batch:
            idx = row[self.IDX_IN_BATCH_COLUMN]
            try:
                prompt, sampling = request(row)
                groups.setdefault(extract_sampling(sampling), []).append((idx, prompt))
            except Exception as error:
                out.append(self._failed(idx, error, batch_uuid, engine))
        done = 0
        for key, todo in groups.items():
            sampling = dict(key)
            prompts = [prompt for _, prompt in todo]
            started = time.perf_counter()
            try:
                results = self._extract(engine, prompts, sampling)
            except Exception as error:
                self._check(error)
                # A refused prompt is found by running each alone, each in a part of its own.
                results = [error] if len(todo) == 1 else [self._extract_alone(engine, p, sampling) for p in prompts]
            seconds = time.perf_counter() - started
            for (idx, _), result in zip(todo, results):
                if isinstance(result, BaseException):
                    out.append(self._failed(idx, result, batch_uuid, engine))
                else:
                    out.append(activation_row(idx, *result, batch_uuid=batch_uuid, seconds=seconds,
                                              sampling=sampling))
                    done += 1
        self._done(engine, done, time.perf_counter(), None)
        return out

    def _extract(self, engine: Engine, prompts: list[Any], sampling: dict[str, Any]) -> list[Any]:
        """One part: submitted, awaited, committed. Per prompt ``(files, index, rows, prompt ids, generated ids,
        text)``, or the error of a prompt the ranks hold no rows of; raises when the part failed."""
        from ..errors import RequestError

        spec = self.activations
        part = f"part-{uuid.uuid4().hex}"
        requests = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
        indices = list(range(len(prompts)))
        model = engine.model
        entry = model.vllm_entrypoint  # the ranks keep the part's rows until its commit writes them
        ref = engine.thread.submit(entry.extract_async, requests, part, spec["dir"], spec["locations"],
                                   indices=indices, dtype=None if spec["dtype"] == "auto" else spec["dtype"],
                                   max_tokens=sampling["max_tokens"], temperature=sampling.get("temperature", 0.0),
                                   generated=spec["generated"]).result()
        try:
            outputs = entry.wait(ref)
        except BaseException:
            entry.extract_discard(part)
            raise
        written = collect_commits(entry.extract_commit(part, fsync=spec["fsync"]), part)
        if isinstance(written, BaseException):
            raise written
        files, counts = part_rows(written, indices)
        tokenizer = getattr(model, "tokenizer", None)
        results: list[Any] = []
        for output, index, count in zip(outputs, indices, counts):
            if count is None:
                results.append(RequestError(f"the engine's ranks wrote no rows of this prompt in {part}"))
                continue
            generated = list(output.outputs[0].token_ids)
            text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
            results.append((files, index, count, list(output.prompt_token_ids), generated, text))
        return results

    def _extract_alone(self, engine: Engine, prompt: Any, sampling: dict[str, Any]) -> Any:
        try:
            return self._extract(engine, [prompt], sampling)[0]
        except Exception as error:
            self._check(error)
            return error

    def _check(self, error: BaseException) -> None:
        """An engine failure ends the actor; a row's failure fails the batch unless rows may fail alone."""
        if is_fatal(error):
            logger.error("nnsight engine failed (%s: %s); exiting the actor so Ray Data restarts it",
                         type(error).__name__, error)
            os._exit(1)  # as Ray Data LLM's vLLM stage: a retry must not reach this dead engine
        if not self.should_continue_on_error:
            from ..errors import RequestError

            raise RequestError(describe_error(error)) from error

    def _failed(self, idx: Any, error: BaseException, batch_uuid: str, engine: Engine) -> dict[str, Any]:
        self._check(error)
        metrics.inc("nnsight_data_rows", engine=engine.name, outcome="failed", type=type(error).__name__)
        message = describe_error(error)
        logger.warning("row %s of batch %s failed: %s", idx, batch_uuid, message)
        return failure_row(idx, message, self.names, batch_uuid)

    def __del__(self) -> None:
        waits = getattr(self, "_waits", None)
        if waits is not None:
            waits.shutdown(wait=False)
        for engine in getattr(self, "engines", []):
            engine.thread.shutdown(wait=False)
            if engine.owned:  # a connected engine is its deployment owner's to stop
                from .placement import stop_engine

                stop_engine(engine.model)


class NNsightEngineStage(StatefulStage):
    """The engine stage of an ``NNsightEngineProcessorConfig`` processor."""

    fn: type[StatefulStageUDF] = NNsightEngineStageUDF

    def get_required_input_keys(self) -> dict[str, str]:
        return {"sampling_params": "vLLM SamplingParams fields for this row's request (max_tokens, temperature, ...)."}

    def get_optional_input_keys(self) -> dict[str, str]:
        return {
            "prompt": "The prompt text. Required unless tokenized_prompt is given.",
            "tokenized_prompt": "The prompt's token ids (used instead of prompt when given).",
        }
