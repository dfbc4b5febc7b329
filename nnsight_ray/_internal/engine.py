"""The engine actor's logic: owns vLLM's async engine, submits, collects, hands off.

vLLM's ``AsyncLLM`` already runs the step loop continuously (its engine core
busy loop in a child process, its output handler as a task on this actor's
event loop) and batches every caller's requests together. This class adds
what nnsight's ``NNsightLLMEngine.step`` adds in-process, distributed:

1. *Submit.* Requests arrive with their nnsight blocks already serialized into
   ``SamplingParams.extra_args`` (the client ran nnsight's own
   ``_attach_mediators``), exactly as nnsight's in-process engine receives them.
2. *Collect.* Every finished request (traced or not: registered blocks run on
   requests nnsight never made) is collected on every rank. Requests finishing
   close together share one ``collective_rpc("nnsight_ray_stash")``; each rank
   keeps its payload locally (see ``rank_worker``).
3. *Hand off.* The engine tells the merge actor which requests are done and
   moves on. It never waits for a payload to move or merge, and never holds one.

No Ray calls here except through the ``notify`` callable and ``health``, which
``deploy.EngineActor`` supplies.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from typing import Any, Awaitable, Callable

from ..errors import EngineDeadError

logger = logging.getLogger(__name__)

# (group, index, request_id, finished output or None, error or None)
Report = tuple[str, int, str, Any, "BaseException | None"]
# Hands a batch of finished requests to the merge actors (never blocks).
Notify = Callable[[list[Report]], None]
# -> the full "engine is dead: ..." message
DescribeDead = Callable[[], Awaitable[str]]


class EngineCore:
    """One vLLM ``AsyncLLM`` with nnsight's workers on Ray rank actors."""

    def __init__(self, llm: Any, notify: Notify, describe_dead: DescribeDead) -> None:
        self.llm = llm
        self.notify = notify
        self.describe_dead = describe_dead
        self.dead: EngineDeadError | None = None
        self._pending: list[Report] = []
        self._flush: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        # Time the loop spent in collection: the stash RPCs, during which vLLM's
        # engine core runs no step (health() reports it; see the stall benchmark).
        self.collect_stats = {"calls": 0, "requests": 0, "seconds": 0.0, "max_s": 0.0}

    # -- submit -------------------------------------------------------------

    def submit(self, group: str, prompts: list, params: list, loras: list | None = None) -> None:
        """Start one request per prompt; each reports to the merge actor when done."""
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            lora = loras[index] if loras else None
            task = asyncio.ensure_future(self._run(group, index, prompt, param, lora))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, group: str, index: int, prompt: Any, param: Any, lora: Any) -> None:
        request_id = f"{group}-{index}"
        output, error = None, None
        try:
            if self.dead is not None:
                raise self.dead
            async for output in self.llm.generate(prompt, param, request_id, lora_request=lora):
                pass
        except asyncio.CancelledError:
            error = self.dead or RuntimeError(f"request {request_id} was cancelled")
        except Exception as exception:  # bad prompt, engine dead, ...
            error = await self._explain(exception)
        finished = output is not None and output.finished and error is None
        self.finish(group, index, request_id, output if finished else None, error)

    async def stream(self, group: str, prompt: Any, param: Any, lora: Any = None):
        """Yield each step's output as vLLM produces it (one request, group of one).

        The finished output is collected and handed to the merge actor like any
        other; a consumer that closes the stream early aborts the request, and the
        ``finally`` winds its workers up on every rank, so nothing leaks.
        """
        request_id = f"{group}-0"
        output, error, finished = None, None, False
        try:
            if self.dead is not None:
                raise self.dead
            async for output in self.llm.generate(prompt, param, request_id, lora_request=lora):
                finished = output.finished
                yield output
        except Exception as exception:
            error = await self._explain(exception)
            raise error from exception
        finally:
            if not finished:
                await self.llm.abort(request_id)
                error = error or RuntimeError(f"stream {request_id} was closed before it finished")
            self.finish(group, 0, request_id, output if finished else None, error)

    # -- collect ------------------------------------------------------------

    def finish(self, group: str, index: int, request_id: str, output: Any, error: BaseException | None) -> None:
        """Queue a finished (or failed, or aborted) request for collection; never waits.

        Requests finishing close together are collected by one
        ``collective_rpc("nnsight_ray_stash")`` and handed to the merge actors in
        one batch, so per-request cost on the engine's event loop is a list append.
        """
        self._pending.append((group, index, request_id, output, error))
        if self._flush is None or self._flush.done():
            self._flush = asyncio.ensure_future(self._flush_pending())

    async def _flush_pending(self) -> None:
        await asyncio.sleep(0)  # let every request finishing in this step enqueue first
        while self._pending:
            batch, self._pending = self._pending, []
            if self.dead is None:
                ids = [rid for _, _, rid, _, _ in batch]
                outputs = {rid: out for _, _, rid, out, _ in batch if out is not None}
                began = time.perf_counter()
                try:
                    await self.llm.collective_rpc(
                        "nnsight_ray_stash", args=(ids, pickle.dumps(outputs) if outputs else None)
                    )
                except Exception as exception:
                    failure = await self._explain(exception)
                    batch = [(g, i, rid, None, err or failure) for g, i, rid, _, err in batch]
                spent = time.perf_counter() - began
                stats = self.collect_stats
                stats["calls"] += 1
                stats["requests"] += len(ids)
                stats["seconds"] += spent
                stats["max_s"] = max(stats["max_s"], spent)
            else:
                batch = [(g, i, rid, None, err or self.dead) for g, i, rid, _, err in batch]
            self.notify(batch)

    # -- health -------------------------------------------------------------

    async def _explain(self, exception: BaseException) -> BaseException:
        """Turn vLLM's engine-dead error into one that names the dead rank(s)."""
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

        if isinstance(exception, EngineDeadError):
            return exception
        if self.dead is not None:
            return self.dead
        if isinstance(exception, VLLMEngineDead) or getattr(self.llm, "errored", False):
            await self.fail(EngineDeadError(await self.describe_dead()))
            return self.dead
        return exception

    async def fail(self, error: EngineDeadError) -> None:
        """Declare the engine dead: every pending request fails with ``error``, now."""
        if self.dead is not None:
            return
        self.dead = error
        logger.error("%s", error)
        for task in list(self._tasks):
            task.cancel()
        try:
            self.llm.shutdown()
        except Exception:
            logger.debug("engine shutdown after failure raised", exc_info=True)

    async def rpc(self, method: str, args: tuple = ()) -> list:
        if self.dead is not None:
            raise self.dead
        try:
            return await self.llm.collective_rpc(method, args=args)
        except Exception as exception:
            raise await self._explain(exception) from exception
