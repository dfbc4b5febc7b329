"""The engine stage: a stateful ``map_batches`` UDF that runs each batch as one nnsight trace.

``NNsightEngineStage`` is a Ray Data LLM ``StatefulStage``; Ray Data runs its
UDF on an actor pool (``compute=ActorPoolStrategy``, ``concurrency`` as Ray
Data LLM defines it). Each actor holds one engine: a ``LocalVLLM`` at TP x PP
= 1, a ``RayVLLM`` above, whose rank actors take the bundles of the
placement group the actor runs in (``placement``). It is built on the actor's
one tracing thread, which every trace then runs on (one tracing thread per
client object); the actor's event loop stays free. When Ray Data lets the
actor go, the engine is shut down (and, for a ``RayVLLM``, the actor's group
removed: ``placement.stop_engine``).

Per batch: one trace with one invoke per row (the row's prompt and its own
sampling parameters), each invoke running the config's saves
(``batch.interventions.read_saves``) or the user's ``intervene``, then reading
the request's output (``tracer.result``) for the generated tokens and text.

A failure, as the batch runner isolates it (``batch.scheduler``): a trace of
several rows that fails is run again one row per trace, so the failing row is
found and every other row keeps its values; a single row's failure is that
row's ``__inference_error__`` (``"<Type>: <message>"``) when
``should_continue_on_error``, else the batch (and the run) fails with it. An
engine that died (vLLM's ``EngineDeadError``) ends the actor, as Ray Data
LLM's vLLM stage does, so Ray Data restarts it and retries the batch on a
live engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Sequence

from ray.llm._internal.batch.stages.base import StatefulStage, StatefulStageUDF

from .columns import describe_error, failure_row, request, success_row

logger = logging.getLogger(__name__)

__all__ = ["NNsightEngineStage", "NNsightEngineStageUDF", "run_trace"]


def run_trace(model: Any, fn: Callable, requests: Sequence[tuple[Any, dict[str, Any]]]) -> list[tuple]:
    """One trace, one invoke per ``(prompt, sampling)``: each invoke's ``(values, prompt ids, generated ids, text)``.

    ``rows`` is bound and saved above the invokes, so each request's copy
    carries its own slot and nnsight merges them slot-wise (as the batch
    runner's ``submit_trace``).
    """
    import nnsight

    with model.trace() as tracer:
        rows = nnsight.save([None] * len(requests))
        for i, (prompt, sampling) in enumerate(requests):
            with tracer.invoke(prompt, **sampling):
                values = fn(model, tracer)
                result = tracer.result
                rows[i] = (values, list(result.prompt_token_ids), list(result.outputs[0].token_ids),
                           result.outputs[0].text)
    return list(rows)


def is_fatal(error: BaseException) -> bool:
    """The engine (not the request) failed: the actor must go."""
    from ray.llm._internal.common.errors import VLLM_FATAL_ERRORS

    from ..batch.replicas import classify

    return isinstance(error, VLLM_FATAL_ERRORS) or classify(error) == "lost"


class NNsightEngineStageUDF(StatefulStageUDF):
    """One engine per actor; a batch of rows -> one trace -> the rows' columns."""

    def __init__(self, data_column: str, expected_input_keys: list[str], model_source: str,
                 engine_kwargs: dict[str, Any], saves: list[dict[str, Any]] | None, intervene: Callable | None,
                 should_continue_on_error: bool = False, placement: dict[str, Any] | None = None) -> None:
        super().__init__(data_column, expected_input_keys)
        self.should_continue_on_error = should_continue_on_error
        self.names = [spec["location"] for spec in saves or []]
        # Every trace runs on this one thread, the one that built the model.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nnsight-data")
        self.model, self.fn = self._thread.submit(self._start, model_source, engine_kwargs, saves,
                                                  intervene, placement).result()

    @staticmethod
    def _start(model_source: str, engine_kwargs: dict[str, Any], saves: list[dict[str, Any]] | None,
               intervene: Callable | None, placement: dict[str, Any] | None = None) -> tuple[Any, Callable]:
        from ..batch.config import SaveSpec
        from ..batch.interventions import reader, resolve_saves
        from ..local import LocalVLLM
        from .placement import start_engine

        started = time.monotonic()
        if placement is not None:  # TP x PP > 1: ranks in this actor's placement group
            model = start_engine(model_source, engine_kwargs, placement)
        else:
            model = LocalVLLM(model_source, dispatch=True, **engine_kwargs)
        logger.info("nnsight engine for %s ready in %.1f s", model_source, time.monotonic() - started)
        if intervene is not None:
            return model, intervene
        return model, reader(resolve_saves(model._module, [SaveSpec(**spec) for spec in saves or []]))

    async def udf(self, batch: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        for row in await loop.run_in_executor(self._thread, self.run_batch, batch):
            yield row

    # -- on the tracing thread -------------------------------------------------

    def run_batch(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        batch_uuid = uuid.uuid4().hex
        out: list[dict[str, Any]] = []
        todo: list[tuple[Any, Any, dict[str, Any]]] = []
        for row in batch:
            idx = row[self.IDX_IN_BATCH_COLUMN]
            try:
                todo.append((idx, *request(row)))
            except Exception as error:
                out.append(self._failed(idx, error, batch_uuid))
        if not todo:
            return out
        started = time.perf_counter()
        try:
            results = run_trace(self.model, self.fn, [(prompt, sampling) for _, prompt, sampling in todo])
        except Exception as error:
            self._check(error)
            # As the batch runner's scheduler: the failing row is found by running each alone.
            results = [error] if len(todo) == 1 else [self._alone(prompt, sampling) for _, prompt, sampling in todo]
        seconds = time.perf_counter() - started
        for (idx, _, sampling), result in zip(todo, results):
            if isinstance(result, BaseException):
                out.append(self._failed(idx, result, batch_uuid))
                continue
            values, prompt_ids, generated, text = result
            try:
                out.append(success_row(idx, values, prompt_ids, generated, text, batch_uuid, seconds, sampling))
            except Exception as error:  # intervene() returned a value no column can hold
                out.append(self._failed(idx, error, batch_uuid))
        return out

    def _alone(self, prompt: Any, sampling: dict[str, Any]) -> Any:
        try:
            return run_trace(self.model, self.fn, [(prompt, sampling)])[0]
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

    def _failed(self, idx: Any, error: BaseException, batch_uuid: str) -> dict[str, Any]:
        self._check(error)
        message = describe_error(error)
        logger.warning("row %s of batch %s failed: %s", idx, batch_uuid, message)
        return failure_row(idx, message, self.names, batch_uuid)

    def __del__(self) -> None:
        model = getattr(self, "model", None)
        if model is not None:
            from .placement import stop_engine

            stop_engine(model)


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
