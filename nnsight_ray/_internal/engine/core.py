"""The engine actor's logic: owns vLLM's async engine, submits, collects, hands off.

vLLM's ``AsyncLLM`` already runs the step loop continuously (its engine core
busy loop in a child process, its output handler as a task on this actor's
event loop) and batches every caller's requests together. This class adds
what nnsight's ``NNsightLLMEngine.step`` adds in-process, distributed:

1. *Submit.* Requests arrive with their nnsight blocks already serialized into
   ``SamplingParams.extra_args`` (the client ran nnsight's own
   ``_attach_mediators``), exactly as nnsight's in-process engine receives them.
2. *Collect.* Every finished request (traced or not: registered blocks run on
   requests nnsight never made) is collected on every rank, a call's requests
   together at its last end, by one ``collective_rpc("nnsight_ray_stash")``; each
   rank keeps its payload locally (see ``ranks/rpcs.py``).
3. *Hand off.* The engine tells the merge actor which requests are done and
   moves on. It never waits for a payload to move or merge, and never holds one.

4. *Always report.* Every request submitted reaches ``notify`` exactly once,
   whatever happens: finished, refused, aborted, or failed because the engine
   died. ``fail`` hands every request not yet reported over itself, at once,
   with the engine's death message, so a caller never waits on a request task
   that was cancelled, or on a collection stuck in a collective with a dead rank.

No Ray calls here except through the ``notify`` and ``describe_dead``
callables, which ``deploy.EngineActor`` supplies. ``engine_args`` is the
engine actor's start-up: what it hands vLLM's ``AsyncEngineArgs``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ...errors import EngineDeadError, RequestError
from ..observe import metrics
from . import render
from .render import render_batch, render_batches
from ..observe.progress import Progress
from ..observe.timeline import ADDED, COLLECT, ENDED, RENDER, SUBMIT, Timeline, watch_gc

logger = logging.getLogger(__name__)

# How long explaining an engine death may take (a GCS read) before a plainer message is used.
DESCRIBE_TIMEOUT_S = 8.0


@dataclass
class Report:
    """One request as the merge actor hears of it: finished (``output``) or failed (``error``)."""

    group: str
    index: int
    request_id: str
    output: Any = None
    error: BaseException | None = None
    # Whether the ranks hold anything of it (a block, a registered copy, an error):
    # False for a plain request on an engine with no registered block, which is
    # not collected at all (``EngineCore.needs_collect``); the merge takes nothing for it.
    collected: bool = True
    # The request carries a block of its own, or names registered edits.
    carries_block: bool = False
    # Its end was taken (``EngineCore.finish``): a second finish of the same request is ignored.
    ended: bool = False


# Hands a batch of finished requests to the merge actors (never blocks).
Notify = Callable[[list[Report]], None]
# -> the full "the engine is dead: ..." message
DescribeDead = Callable[[], Awaitable[str]]


def refusal(exception: BaseException) -> BaseException:
    """vLLM's ``EngineGenerateError`` says nothing (its cause has the reason): the cause, in words."""
    cause = exception.__cause__
    if str(exception) or cause is None:
        return exception
    return RequestError(f"vLLM refused the request: {type(cause).__name__}: {cause}")


def carries_block(param: Any) -> bool:
    """Whether a request's sampling params carry an nnsight block, or name registered edits.

    nnsight's client puts a traced request's block in ``extra_args["nnsight_mediator"]``
    and a request's edit names in ``extra_args["nnsight_edits"]`` (an unknown
    name is that request's error, which only a collection reports).
    """
    extra = getattr(param, "extra_args", None) or {}
    return "nnsight_mediator" in extra or extra.get("nnsight_edits") is not None


# Collective RPCs that install and remove registered blocks (nnsight's registration.py).
REGISTER, UNREGISTER = "nnsight_register", "nnsight_clear_registered"


def final_only(param: Any) -> Any:
    """``param``, set to ask vLLM for the finished output only.

    In place: the engine actor's own copy (it arrived pickled), never the caller's.
    """
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    if isinstance(param, SamplingParams):
        param.output_kind = RequestOutputKind.FINAL_ONLY
    return param


def engine_args(spec: Any) -> tuple[dict[str, Any], list[str]]:
    """``AsyncEngineArgs`` keywords for a ``deploy.DeploymentSpec``, and what nnsight changed (with why).

    vLLM's own entry point's argument defaults (``parity.entrypoint_kwargs``:
    ``vllm.LLM``'s, or the OpenAI server's for Serve) and nnsight's settings
    (chunked prefill and prefix caching off, eager unless ``enforce_eager=False``
    or ``taps``: ``graphs.engine_mode``), never over the user's; the
    platform's defaults; the placement plan and nnsight_ray's executor riding
    vLLM's config; nnsight_ray's worker.
    """
    from ..blocks import graphs
    from . import parity, platform
    from ..ranks.executor import engine_kwargs_with
    from ..ranks.limits import engine_limits

    kwargs, graph_changes = graphs.engine_mode(engine_limits(platform.engine_defaults(spec.engine_kwargs)))
    kwargs, changed = parity.entrypoint_kwargs(kwargs, parity.usage_context(spec.usage_context))
    changed += graph_changes
    kwargs = engine_kwargs_with(spec.placement, kwargs)
    return {"model": spec.model, "worker_cls": platform.worker_cls(), **kwargs}, changed


# How long a dead engine's loop serves its waiters before vLLM's (blocking) shutdown.
SHUTDOWN_AFTER_DEATH_S = 0.5

# Loop turns a collection waits at most for more requests of the same step to end (``EngineCore._settle``);
# "1" waits one turn, as before issue 53 (``--engines ray,ray%old --env old=NNSIGHT_RAY_SETTLE_TURNS=1``).
SETTLE_TURNS = max(1, int(os.environ.get("NNSIGHT_RAY_SETTLE_TURNS", "16")))

# A call's ended requests wait to be collected until its last one ends, up to this many (``EngineCore.finish``):
# its prompts may start over several steps (256 on the 2-core CPU engine: 3), so end over several, and each
# collection is a stash collective during which the engine core runs no step, though the caller gets nothing
# before the call's last end. The cap bounds what a rank holds uncollected (on a GPU: saves on the device).
# "0": each step's ends at once, as before issue 53 (``--env old=NNSIGHT_RAY_PARK_MAX=0``).
PARK_MAX = int(os.environ.get("NNSIGHT_RAY_PARK_MAX", "1024"))

# "1" (the default): an idle engine's scheduler is held (vLLM's ``pause_scheduler``, mode "keep") while a
# call's first render batch is added, so its requests start in one step (``EngineCore._hold``); "0": not held
# (``python -m benchmarks.gpu --engines ray,ray%nohold --env nohold=NNSIGHT_RAY_HOLD_ADDS=0`` compares them).
HOLD_ADDS = os.environ.get("NNSIGHT_RAY_HOLD_ADDS", "1") == "1"


@dataclass
class _End:
    """The last item of a stream's queue: how its request ended."""

    error: BaseException | None


class EngineCore:
    """One vLLM ``AsyncLLM`` with nnsight's workers on Ray rank actors."""

    def __init__(self, llm: Any, notify: Notify, describe_dead: DescribeDead,
                 on_dead: Callable[[EngineDeadError], None] | None = None, progress: Progress | None = None) -> None:
        self.llm = llm
        # Steps finished (vLLM's stat-logger seam, wired by the engine actor) against work waiting.
        self.progress = progress or Progress()
        self.notify = notify
        self.describe_dead = describe_dead
        self.on_dead = on_dead
        self.dead: EngineDeadError | None = None
        # Every request submitted and not yet handed to ``notify``, by request id.
        self._unreported: dict[str, Report] = {}
        self._pending: list[Report] = []
        # Requests of each group (a call) not ended yet, and its ended requests whose collection waits for
        # the group's last end (``finish``: one stash collective per call, not one per step some of it ends in).
        self._open: dict[str, int] = {}
        self._parked: dict[str, list[Report]] = {}
        self._flush: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._died = asyncio.Event()
        # Registration ids of the blocks installed on every rank (``rpc``): while
        # there are none, a request with no block of its own leaves nothing on
        # any rank and is not collected (nnsight's runner forgets it off the
        # scheduler's finished set, ``Requests.harvest``).
        self.registered: set[str] = set()
        # Time the loop spent in collection: the stash RPCs, during which vLLM's
        # engine core runs no step (health() reports it; see the stall benchmark).
        self.collect_stats = {"calls": 0, "requests": 0, "seconds": 0.0, "max_s": 0.0}
        # Submits, adds and ends, for a run's timeline (``timeline.summarize``).
        self.timeline = Timeline()
        watch_gc()

    def load(self) -> dict[str, Any]:
        """Requests not yet handed over, how long the engine has gone without a step while they wait, and if dead."""
        in_flight = len(self._unreported)
        return {"in_flight": in_flight, "stalled_s": self.progress.stalled_s(in_flight), "dead": self.dead is not None}

    # -- submit -------------------------------------------------------------

    def submit(self, group: str, prompts: list, params: list, loras: list | None = None) -> None:
        """Start one request per prompt; each reports to the merge actor when done.

        Only the finished output is reported, so vLLM is asked for that alone
        (``FINAL_ONLY``, as ``vllm.LLM.generate`` asks): with its default
        (every step's cumulative output) this loop would build and drop one
        output per request per step. Streams (``stream``) keep every step.
        """
        reports = [self._track(group, index, param) for index, param in enumerate(params[:len(prompts)])]
        self.timeline.mark(SUBMIT, len(reports))
        if len(reports) < 2:
            for report, prompt, param in zip(reports, prompts, params):
                self._start(report, prompt, final_only(param), loras[0] if loras else None)
            return
        task = asyncio.ensure_future(self._start_rendered(reports, prompts, params, loras))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_rendered(self, reports: list[Report], prompts: list, params: list, loras: list | None) -> None:
        """Render a call's prompts in batches (vLLM's renderer, as ``vllm.LLM`` does), adding each batch
        as soon as it is rendered: a batch's requests reach the engine core together and start in the
        same step, and the core steps on one batch while the next is tokenized.

        Added one by one, each raw prompt was tokenized on its own in a thread while
        the core already stepped on those that arrived, so a trace of 256 invokes
        started in waves over several (mixed, eager) steps, and the blocks of one
        wave sat parked while the others ran. Rendered all at once, a call of
        2,048 prompts of 256 tokens added its first request after all were
        tokenized: 0.56-0.85 s on the 2-core machine, 13-20 ms in batches
        (``python -m benchmarks.submit``). A call that fits in one step renders as one
        batch; a longer one in batches growing from an eighth of a step to a step
        (``render_batches``).
        A batch that does not render (a prompt vLLM refuses) goes request by
        request, so only its bad prompt fails.
        """
        started = 0
        held = await self._hold(reports)
        try:
            for batch in render_batches(prompts, self.render_batch_chars):
                began = time.monotonic()
                rendered = await self._render([prompts[i] for i in batch])
                self.timeline.mark(RENDER, len(batch), began)
                for position, index in enumerate(batch):
                    prompt = rendered[position] if rendered is not None else prompts[index]
                    self._start(reports[index], prompt, final_only(params[index]), loras[index] if loras else None)
                    started += 1
                if held:
                    await self._release([reports[index] for index in batch])
                    held = False
        finally:
            for report in reports[started:]:  # cancelled (the engine died) before they started
                self.finish(report, None, self.dead or RuntimeError(
                    f"request {report.request_id} was closed before it started"))
            if held:  # last: cancelled again while it resumes, nothing above is skipped
                await self._release([])

    async def _hold(self, reports: list[Report]) -> bool:
        """Pause an idle engine's scheduler for a call's first adds (``HOLD_ADDS``); True if paused.

        vLLM's engine core steps as soon as its first request arrives; a call's
        adds reach it one by one over ~30 ms (256 requests on the H200), so its
        prompts otherwise start over several part-full steps and the last ones
        finish several steps after the first. Held (mode "keep": nothing steps,
        adds queue), the first render batch's requests start in one step. Only
        an idle engine is held (nothing else of this engine's in flight): a busy
        one keeps stepping, and vLLM's pause would wait for it to drain.
        """
        if not HOLD_ADDS or len(self._unreported) != len(reports) or self.dead is not None:
            return False
        try:
            await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
            return True
        except Exception:  # noqa: BLE001 - the adds go on unheld
            logger.debug("could not hold the scheduler for a call's adds", exc_info=True)
            return False

    async def _release(self, reports: list[Report]) -> None:
        """Resume the scheduler ``_hold`` paused, once ``reports``' adds have gone to the engine core.

        Each add is sent from its own task (``_run``); the core takes its input in
        order, so a resume sent after the adds finds them queued. An add not yet
        sent after a few loop turns only starts a step later.
        """
        added = getattr(self.llm.output_processor, "external_req_ids", {})  # vLLM's ids by the caller's
        for _ in range(16):
            if all(report.request_id in added for report in reports):
                break
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        try:
            await self.llm.engine_core.resume_scheduler_async()
        except Exception:  # noqa: BLE001 - a dead engine fails its requests on its own
            logger.warning("could not resume the scheduler after a call's adds", exc_info=True)

    @property
    def render_batch_chars(self) -> int:
        """Text per render batch: about one step of the engine (4 characters a token, a typical BPE rate)."""
        if render.RENDER_BATCH_CHARS > 0:
            return render.RENDER_BATCH_CHARS
        scheduler = getattr(getattr(self.llm, "vllm_config", None), "scheduler_config", None)
        tokens = getattr(scheduler, "max_num_batched_tokens", None)
        return 4 * tokens if isinstance(tokens, int) and tokens > 0 else 65536

    async def _render(self, prompts: list) -> list | None:
        """``prompts`` as vLLM's engine inputs (``Renderer.render_cmpl``, the defaults a raw prompt gets), or None.

        The batch renders in one call on the renderer's own tokenizer thread
        (``render_batch``), not with ``render_cmpl_async``: that one hands each
        prompt to the thread on its own, and the future, the callback and the
        wake-up per prompt ran on this actor's event loop, the same loop that
        adds the requests and takes their outputs. On the H200
        (benchmarks/results/HISTORY.md) the GPU sat idle ~0.5 s of a 2 s
        prefill run waiting for requests to arrive.
        """
        try:
            from vllm.renderers.inputs.preprocess import parse_model_prompt

            renderer = self.llm.renderer
            parsed = [parse_model_prompt(self.llm.model_config, prompt) for prompt in prompts]
            # vLLM's renderer tokenizes on its own executor (one tokenizer, one thread at a time).
            executor = getattr(renderer, "_executor", None)
            return list(await asyncio.get_running_loop().run_in_executor(executor, render_batch, renderer, parsed))
        except Exception:  # noqa: BLE001 - each request renders, and fails, on its own
            logger.debug("rendering %d prompts together failed; adding them one by one", len(prompts),
                         exc_info=True)
            return None

    def _track(self, group: str, index: int, param: Any = None) -> Report:
        report = Report(group, index, f"{group}-{index}", carries_block=carries_block(param))
        self._open[group] = self._open.get(group, 0) + 1
        self.progress.busy(was_idle=not self._unreported)
        self._unreported[report.request_id] = report
        return report

    def _start(self, report: Report, prompt: Any, param: Any, lora: Any, queue: asyncio.Queue | None = None):
        task = asyncio.ensure_future(self._run(report, prompt, param, lora, queue))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run(self, report: Report, prompt: Any, param: Any, lora: Any,
                   queue: asyncio.Queue | None = None) -> None:
        """Run one request to its end and report it, whatever ends it.

        ``queue`` (streams) receives every step's output, then an ``_End``.
        Cancelled (by ``fail``, or a stream consumer that left) or not, the
        ``finally`` reports: no path out of here skips ``finish``.
        """
        output, error = None, None
        self.timeline.mark(ADDED)  # its task starts: vLLM's add_request is next
        try:
            try:
                if self.dead is not None:
                    raise self.dead
                async for output in self.llm.generate(prompt, param, report.request_id, lora_request=lora):
                    if queue is not None:
                        queue.put_nowait(output)
            except Exception as exception:  # bad prompt, engine dead, ...
                error = await self._explain(exception)
        except BaseException:  # cancelled, possibly while explaining
            error = self.dead or error or RuntimeError(
                f"{'stream' if queue is not None else 'request'} {report.request_id} "
                "was closed before it finished")
        finally:
            finished = output is not None and output.finished and error is None
            if not finished and error is None:
                error = RuntimeError(f"request {report.request_id} ended without a finished output")
            self.finish(report, output if finished else None, error)
            if queue is not None:
                queue.put_nowait(_End(error))

    async def stream(self, group: str, prompt: Any, param: Any, lora: Any = None):
        """Yield each step's output as vLLM produces it (one request, group of one).

        The finished output is collected and handed to the merge actor like any
        other; a consumer that closes the stream early cancels the request's task
        (vLLM aborts the request), which still reports, so its workers are wound
        up on every rank and nothing leaks. An engine death ends the stream with
        the engine's error.
        """
        queue: asyncio.Queue = asyncio.Queue()
        task = self._start(self._track(group, 0, param), prompt, param, lora, queue)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            if not task.done():
                task.cancel()

    # -- collect ------------------------------------------------------------

    def finish(self, report: Report, output: Any, error: BaseException | None) -> None:
        """Queue a finished (or failed, or aborted) request for collection; never waits.

        Requests finishing close together are collected by one
        ``collective_rpc("nnsight_ray_stash")`` and handed to the merge actors in
        one batch, so per-request cost on the engine's event loop is a list append.
        A request the ranks hold something of waits for the other requests of its
        call (``PARK_MAX``): the call's result needs them all, so they are collected
        together. A request already handed over (by ``fail``) is not reported again.
        """
        if report.request_id not in self._unreported or report.ended:
            return
        report.ended = True
        self.timeline.mark(ENDED)
        report.output, report.error = output, error
        report.collected = self.needs_collect(report)
        left = self._open.pop(report.group, 1) - 1
        if left > 0:
            self._open[report.group] = left
        if self.dead is not None:  # nothing to collect from a dead engine
            report.output, report.error = None, error or self.dead
            self._hand_over([report])
            return
        if report.collected and left > 0:
            parked = self._parked.setdefault(report.group, [])
            if len(parked) < PARK_MAX:
                parked.append(report)  # collected with the rest of its call (``PARK_MAX``)
                return
        if report.collected or left == 0:
            self._pending.extend(self._parked.pop(report.group, ()))
        self._pending.append(report)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.ensure_future(self._flush_pending())

    def needs_collect(self, report: Report) -> bool:
        """Whether any rank may hold something of ``report``'s request (decided when it ends).

        A block of its own or edit names: yes. Otherwise only a registered block
        can have run on it; one cleared before the request ended took its
        values with it (``Requests.unregister``), so the set as it is now decides.
        """
        return report.carries_block or bool(self.registered)

    async def _settle(self) -> None:
        """Yield until a loop turn adds no finished request: a step's ends are then all in ``_pending``.

        vLLM's output handler hands a step's outputs over in chunks (``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``,
        128) a loop turn apart, and each request's task reports a turn later: one turn of waiting split
        one step's 300 ends into two stash collectives (tests/unit/test_collect_batching.py). Bounded
        (``SETTLE_TURNS``): ends come once a step, so this stops a few turns after the last chunk.
        """
        seen = -1
        for _ in range(SETTLE_TURNS):
            if len(self._pending) == seen:
                return
            seen = len(self._pending)
            await asyncio.sleep(0)

    async def _flush_pending(self) -> None:
        while True:
            await self._settle()  # every request finishing in this step enqueues first
            if not self._pending:
                return
            batch, self._pending = self._pending, []
            try:
                await self._collect(batch)
            except Exception as exception:  # never leave a batch unreported
                logger.exception("collecting %d finished request(s) failed", len(batch))
                for report in batch:
                    report.output, report.error = None, report.error or exception
            self._hand_over(batch)

    async def _collect(self, batch: list[Report]) -> None:
        """Stash every rank's saves of ``batch`` (one RPC); on failure, fail them all."""
        if self.dead is not None:
            for report in batch:
                report.output, report.error = None, report.error or self.dead
            return
        wanted = [r for r in batch if r.collected]
        if not wanted:  # plain requests, no registered block: nothing on any rank, no collective
            return
        ids = [r.request_id for r in wanted]
        began = time.perf_counter()
        try:
            # No outputs first: a rank answers which blocks are parked on ``tracer.result``, and only those
            # requests' outputs are pickled to the ranks, in a second call (``RankRPCMixin.nnsight_ray_stash``).
            answers = await self.llm.collective_rpc("nnsight_ray_stash", args=(ids, None, "defer"))
            deferred = sorted({rid for answer in answers or () if isinstance(answer, list) for rid in answer})
            if deferred:
                by_id = {r.request_id: r for r in wanted}
                outputs = {rid: by_id[rid].output for rid in deferred if by_id[rid].output is not None}
                await self.llm.collective_rpc(
                    "nnsight_ray_stash", args=(deferred, pickle.dumps(outputs) if outputs else None, "results"))
        except Exception as exception:
            failure = await self._explain(exception)
            for report in wanted:
                report.output, report.error = None, report.error or failure
        spent = time.perf_counter() - began
        self.timeline.mark(COLLECT, len(ids), time.monotonic() - spent)
        stats = self.collect_stats
        stats["calls"] += 1
        stats["requests"] += len(ids)
        stats["seconds"] += spent
        stats["max_s"] = max(stats["max_s"], spent)
        metrics.observe("nnsight_collect_seconds", spent, stage="stash")

    def _hand_over(self, batch: list[Report]) -> None:
        """``notify`` the reports not handed over yet (each request exactly once)."""
        fresh = [r for r in batch if self._unreported.pop(r.request_id, None) is not None]
        if fresh:
            try:
                self.notify(fresh)
            except Exception:
                logger.exception("could not hand %d finished request(s) to the merge actors", len(fresh))

    # -- health -------------------------------------------------------------

    def core_processes(self) -> list[Any]:
        """vLLM's engine-core processes (``multiprocessing`` handles); none before the engine is up."""
        try:
            return list(self.llm.engine_core.resources.engine_manager.processes)
        except AttributeError:
            return []

    async def _explain(self, exception: BaseException) -> BaseException:
        """Turn vLLM's engine-dead error into one that names the dead rank(s)."""
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

        if isinstance(exception, EngineDeadError):
            return exception
        if self.dead is not None:
            return self.dead
        if isinstance(exception, VLLMEngineDead) or getattr(self.llm, "errored", False):
            await self.fail(EngineDeadError(await self._describe()))
            return self.dead
        return refusal(exception)

    async def _describe(self) -> str:
        try:
            return await asyncio.wait_for(self.describe_dead(), DESCRIBE_TIMEOUT_S)
        except Exception:
            logger.warning("could not tell what killed the engine", exc_info=True)
            return ("the engine is dead: vLLM's engine core failed (what died could not be read in "
                    f"{DESCRIBE_TIMEOUT_S:.0f} s; see the engine actor's log)")

    async def fail(self, error: EngineDeadError) -> None:
        """Declare the engine dead: every request not yet reported fails with ``error``, now."""
        if self.dead is not None:
            return
        self.dead = error
        self._died.set()
        logger.error("%s", error)
        # First report, then cancel: a cancelled task (or a collection blocked in
        # a collective with a dead rank) must not be what a caller waits on.
        orphans = list(self._unreported.values())
        for report in orphans:
            report.output, report.error = None, report.error or error
        self._pending, self._parked, self._open = [], {}, {}
        self._hand_over(orphans)
        if self.on_dead is not None:
            try:
                self.on_dead(error)
            except Exception:
                logger.exception("could not pass the engine's death on")
        if self._flush is not None:
            self._flush.cancel()
        for task in list(self._tasks):
            task.cancel()
        # vLLM's shutdown blocks this event loop (seconds, waiting on its
        # engine-core process): the cancelled tasks, and the streams they end,
        # get this loop first, so no waiter learns of the death only after it.
        asyncio.get_running_loop().call_later(SHUTDOWN_AFTER_DEATH_S, self._shutdown_llm)

    def _shutdown_llm(self) -> None:
        try:
            self.llm.shutdown()
        except Exception:
            logger.debug("engine shutdown after failure raised", exc_info=True)

    async def rpc(self, method: str, args: tuple = ()) -> list:
        if self.dead is not None:
            raise self.dead
        if method == REGISTER and args:  # before the call: a rank may have it even if the call fails
            self.registered.add(args[0])
        call = asyncio.ensure_future(self.llm.collective_rpc(method, args=args))
        died = asyncio.ensure_future(self._died.wait())
        try:
            # A collective with a dead rank may never return: the engine's death ends the wait.
            await asyncio.wait({call, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
            if not call.done():
                call.cancel()
        if call.cancelled():
            raise self.dead
        try:
            result = call.result()
        except Exception as exception:
            raise await self._explain(exception) from exception
        if method == UNREGISTER and args:  # on success only: a rank that still has it is collected
            self.registered.discard(args[0])
        return result
