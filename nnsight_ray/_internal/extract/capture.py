"""Activation extraction on the ranks: every prompt token's values, written as shard files by the rank.

The SAE-dataset workload (issue 24) saves a few layers' outputs at every
prompt token of millions of prompts. Carried home the general way (an nnsight
block per request, its saves pickled rank -> merge actor -> object store ->
caller) it ran at 0.03-0.05x of plain prefill on the H200: per request, a
block to serialize, compile and run; per value, a pickle at every hop.

Here no request carries a block. A request asks for extraction in its
``SamplingParams.extra_args`` (``KEY``: the part file it belongs to, its
prompt index, the locations, the dtype), so it is a plain request to vLLM and
to the engine loop (nothing to collect: ``engine.core.carries_block`` is False).
On the rank:

1. ``ExtractRunnerMixin._update_states``: when a step schedules new requests
   that ask for extraction, their rows in the step's flattened batch are
   noted (prefill only: chunked prefill and prefix caching are off on an
   nnsight engine, so a new request's whole prompt is in its first step).
   Steps with none cost a scan of the step's new requests. A request that asks
   for its generated tokens too (``generated``) has its row noted at every
   step it runs after that, its token read from the forward's own input ids;
   those rows are kept per step and sorted at the commit (``extract/rows.py``).
2. A PyTorch forward hook on each asked module (installed once, inert when no
   step is capturing) takes those rows of the module's output as one copy
   (a span's view copied when the step's captured rows are contiguous, as in a
   dataset run, else one ``index_select``; a copy because vLLM's CUDA kernels
   later update a layer's output in place), casts it to the asked dtype
   and starts its copy to page-locked host memory without waiting
   (``Writer.to_host``; where depends on the writer's staging, below).
3. After the forward, the step's copies and a CUDA event go to this process's
   writer thread, which waits on the event and files each request's rows under
   its part.
4. ``commit(part)`` (the driver's call on the rank actor, second actor thread)
   queues behind every capture before it, then writes the part's rows, sorted
   by prompt index and position, as one safetensors file (temp file +
   rename), straight from the host buffers (``write_safetensors``), and
   answers with what it wrote.

Where a step's rows wait for their commit (PyTorch's pinned cache, a fixed ring, or
a fixed pool of slabs) is ``host_memory``'s part, chosen by ``NNSIGHT_RAY_EXTRACT_STAGING`` at the
rank's start and by the rank RPC ``nnsight_ray_extract_staging`` while it holds nothing.

Only the first tensor-parallel rank of each pipeline stage writes (a layer's
output is whole on every TP rank); with pipeline stages each stage writes its
own layers' file of the part, with the same row order (``part.stageK``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..blocks.classes import extend
from .rows import DecodeBlock, StepRequest, capture, part_columns, row_index
from .host_memory import (RING_MB, STAGING, STAGINGS, Staging, _mapped, host_buffer, release_freed_memory,
    release_pinned_cache)
from .safetensors_io import FORMAT, write_safetensors

logger = logging.getLogger(__name__)

# The extra_args key a request asks for extraction with.
KEY = "nnsight_ray_extract"
# Parts not committed within this many seconds are dropped (the driver that owned them is gone).
PART_TTL_S = float(os.environ.get("NNSIGHT_RAY_EXTRACT_TTL_S", "900"))
WRITER_THREADS = int(os.environ.get("NNSIGHT_RAY_EXTRACT_WRITERS", "4"))
# Cached pinned blocks go back once the writer has had nothing to do for this long (0: at once).
PINNED_IDLE_S = float(os.environ.get("NNSIGHT_RAY_EXTRACT_PINNED_IDLE_S", "5"))
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def memory() -> dict[str, Any]:
    """What this process holds for extraction: parts not yet committed, files being written, bytes of host
    buffers holding rows (``host_mb``), the staging ring (its size, bytes in use, seconds hooks waited for
    it, steps that did not fit), and (on CUDA) PyTorch's pinned host cache: bytes it holds (``pinned_mb``), in use (``pinned_active_mb``), blocks
    page-locked so far and the time that took (``torch.cuda.memory.host_memory_stats``). A gauge for
    the rank's memory over a long run (docs/performance.md, "Activation datasets")."""
    found: dict[str, Any] = {"parts": 0, "writing": 0, "host_mb": _mapped[0] / 1e6}
    if _writer is not None:
        with _writer.writing_lock:
            found.update(parts=len(_writer.parts), writing=_writer.writing)
        found.update(_writer.host.gauge())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory.host_memory_stats()
        found.update(pinned_mb=stats.get("allocated_bytes.current", 0) / 1e6,
                     pinned_active_mb=stats.get("active_bytes.current", 0) / 1e6,
                     pinned_allocs=stats.get("num_host_alloc", 0), pinned_frees=stats.get("num_host_free", 0),
                     pinned_alloc_s=stats.get("host_alloc_time.total", 0) / 1e6)
    return found


def request_args(part: str, index: int, directory: str, locations: list[str], dtype: str | None,
                 generated: bool = False) -> dict[str, Any]:
    """What one request puts under ``extra_args[KEY]`` (see ``RemoteEngine.extract_async``). ``generated``:
    the rows of the tokens it generates too (every decode step's row), not only its prompt's."""
    spec = {"part": part, "index": int(index), "dir": directory, "locations": list(locations), "dtype": dtype}
    if generated:
        spec["generated"] = True
    return {KEY: spec}


@dataclass
class StepCapture:
    """One step's extraction: which rows, and the host copies of each location's rows."""

    rows: "torch.Tensor | range"  # flattened-batch rows of every captured token (``row_index``)
    requests: list[StepRequest]  # each request's rows in it (ids None: a decode step's, read from ``ids``)
    dtype: torch.dtype | None
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    wants_ids: bool = False  # a decode step's rows are in it: their tokens are read from the forward's input
    ids: torch.Tensor | None = None  # then: the captured rows' input token ids
    event: Any = None
    step: int = 0  # this rank's step number: the staging ring's spans are freed by it
    slabs: list = field(default_factory=list)  # the pool's slabs holding ``values`` (staging "pool")


@dataclass
class Part:
    """Rows captured for one part file, not yet committed."""

    directory: str
    created: float
    # (prompt index, position of the first row, token ids, {location: rows}): a prompt's rows
    entries: list[tuple[int, int, list[int], dict[str, torch.Tensor]]] = field(default_factory=list)
    blocks: list[DecodeBlock] = field(default_factory=list)  # generated tokens' rows, one block per step
    slabs: list = field(default_factory=list)  # pool slabs its rows are in: released when it is written or dropped

    def done(self) -> None:
        """The part's rows are no longer needed: its slabs go back to the pool once no other part holds them."""
        slabs, self.slabs = self.slabs, []
        for slab in slabs:
            slab.release()


class Writer:
    """This rank process's captures, parts and writer thread (one per process, made on first use)."""

    def __init__(self, stage: int, stages: int, writes: bool) -> None:
        self.stage, self.stages, self.writes = stage, stages, writes
        self.queue: queue.Queue = queue.Queue()
        self.parts: dict[str, Part] = {}
        self.writing = 0  # parts handed to the pool and not yet written
        self.writing_lock = threading.Lock()
        self.filed = 0  # captures filed so far: an idle release checks that none came since it was planned
        self.idle_after_s = PINNED_IDLE_S
        self.host = Staging(STAGING)  # where rows wait (host_memory); ``set_staging`` changes it while idle
        # Files are written by a pool: one thread's write (and fsync) is a fraction of what a disk takes
        # (measured on the GPU host: 1.1 GiB/s for one thread with fsync, 1.8 for four; 3.7 and 14 without).
        self.pool = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="nnsight-ray-extract-write")
        self.thread = threading.Thread(target=self._run, name="nnsight-ray-extract", daemon=True)
        self.thread.start()

    # -- the filing thread: captures and commits in the order they were made ----

    def _run(self) -> None:
        while True:
            kind, item, reply = self.queue.get()
            try:
                if kind == "capture":
                    self._file(item)
                    self.filed += 1
                elif kind == "discard":
                    dropped = self.parts.pop(item, None)
                    if dropped is not None:
                        dropped.done()
                else:  # commit: the part is complete now (FIFO); its file is written by the pool
                    name, fsync = item
                    with self.writing_lock:
                        self.writing += 1
                    # Boxed: the pool's work item keeps its arguments until the call returns,
                    # and the part's rows must be free before an idle writer returns pinned memory.
                    self.pool.submit(self._write_into, reply, name, [self.parts.pop(name, None)], fsync)
                    continue
            except BaseException as error:  # noqa: BLE001 - goes back to the caller
                logger.exception("extraction writer: %s failed", kind)
                if reply is not None:
                    reply.set_exception(error)
                continue
            finally:
                del item  # a filed capture's rows belong to their parts from here
            if reply is not None:
                reply.set_result(None)

    def _write_into(self, reply: Future, name: str, box: list, fsync: bool) -> None:
        part: Part | None = box.pop()
        try:
            written = self._commit(name, part, fsync)
        except BaseException as error:  # noqa: BLE001 - goes back to the caller
            logger.exception("extraction writer: writing %s failed", name)
            reply.set_exception(error)
            return
        finally:
            if part is not None:
                part.done()
            del part  # this part's rows are free from here
            with self.writing_lock:
                self.writing -= 1
                idle = self._holds_nothing()
        release_freed_memory()  # what the written parts freed
        if idle:
            self._release_when_still_idle(self.filed)
        reply.set_result(written)

    def _holds_nothing(self) -> bool:
        """Nothing being written, held or queued (under ``writing_lock``)."""
        return self.writing == 0 and not self.parts and self.queue.empty()

    def _idle(self) -> bool:
        with self.writing_lock:
            return self._holds_nothing()

    def _release_when_still_idle(self, filed: int) -> None:
        """Return the pinned cache if no capture is filed and nothing held for ``idle_after_s`` from now."""
        if self.idle_after_s <= 0:
            if self.host.drop():
                release_pinned_cache()
            return

        def check() -> None:
            if self.filed == filed and self._idle() and self.host.drop():
                release_pinned_cache()

        timer = threading.Timer(self.idle_after_s, check)
        timer.daemon = True
        timer.start()

    def _writes_pending(self) -> bool:
        """Files being written or commits queued: what gives slabs back (``SlabPool.take`` waits on it)."""
        return self.writing > 0 or not self.queue.empty()

    def set_staging(self, mode: str) -> str:
        """Where rows wait from now on (``host_memory``), changed only while this writer holds nothing:
        rows already waiting stay where they are and are written from there. Drops an unused ring."""
        if mode not in STAGINGS:
            raise ValueError(f"extraction staging {mode!r}: expected one of {', '.join(STAGINGS)}")
        with self.writing_lock:
            if not self._holds_nothing():
                raise RuntimeError(f"extraction staging stays {self.host.mode!r}: {len(self.parts)} part(s) held, "
                                   f"{self.writing} being written; commit or discard them first")
            if not self.host.drop():
                raise RuntimeError(f"extraction staging stays {self.host.mode!r}: its host memory holds rows")
            self.host.mode = mode
        return mode

    def to_host(self, taken: torch.Tensor, capture: StepCapture) -> torch.Tensor:
        """Start the copy of device rows ``taken`` to the host (``Staging.to_host``); a slab it takes is the capture's."""
        return self.host.to_host(taken, capture.step, capture.slabs, self._writes_pending)

    def _file(self, capture: StepCapture) -> None:
        if capture.event is not None:
            capture.event.synchronize()
        self.host.unstage(capture.values, capture.step)
        now = time.monotonic()
        try:
            touched: dict[int, Part] = {}
            decoded: dict[int, tuple[Part, dict, list[int], list[int], list[int]]] = {}
            for _, first, count, ids, spec, position in capture.requests:
                part = self.parts.get(spec["part"])
                if part is None:
                    part = self.parts[spec["part"]] = Part(spec["dir"], now)
                if ids is None:  # generated tokens' rows: gathered per part below, sorted at the commit
                    _, _, rows, indices, positions = decoded.setdefault(id(part), (part, spec, [], [], []))
                    rows.extend(range(first, first + count))
                    indices.extend([spec["index"]] * count)
                    positions.extend(range(position, position + count))
                    continue
                values = {loc: v.narrow(0, first, count) for loc, v in capture.values.items()
                          if loc in spec["locations"]}
                part.entries.append((spec["index"], position, ids, values))
                touched[id(part)] = part  # its rows are views of the step's host memory
            for part, spec, rows, indices, positions in decoded.values():
                # Copied out: a step's slab is as large as the largest step, and holding one per decode step
                # until the commit would drain the pool in a few steps; a decode step's rows are few.
                first, span = rows[0], rows[-1] - rows[0] + 1 == len(rows)  # rows ascend: one span, or an index
                taken = torch.tensor(rows, dtype=torch.int64) if not span else None
                pick = (lambda t: t[first:first + len(rows)].clone()) if span else (lambda t: t.index_select(0, taken))
                part.blocks.append(DecodeBlock(
                    torch.tensor(indices, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                    pick(capture.ids) if capture.ids is not None else torch.zeros(len(rows), dtype=torch.int64),
                    {loc: pick(v) for loc, v in capture.values.items() if loc in spec["locations"]}))
            for slab in capture.slabs:  # held by every part this step filed rows under
                slab.hold(len(touched))
            for part in touched.values():
                part.slabs.extend(capture.slabs)
        finally:
            for slab in capture.slabs:  # the capture's own hold (``SlabPool.take``)
                slab.release()
            capture.slabs = []
        for name in [n for n, p in self.parts.items() if now - p.created > PART_TTL_S]:
            logger.warning("extraction part %s was never committed; dropped", name)
            self.parts.pop(name).done()

    def _commit(self, name: str, part: "Part | None", fsync: bool) -> dict[str, Any] | None:
        if not self.writes:
            return None
        if part is None:
            return {"file": None, "prompts": {}, "rows": 0, "bytes": 0, "stage": self.stage}
        columns, order, counts, locations, replayed = part_columns(part.entries, part.blocks)
        suffix = f".stage{self.stage}" if self.stages > 1 else ""
        path = os.path.join(part.directory, f"{name}{suffix}.safetensors")
        os.makedirs(part.directory, exist_ok=True)
        temporary = f"{path}.tmp-{os.getpid()}"
        write_safetensors(temporary, columns, {"format": FORMAT, "stage": str(self.stage), "stages": str(self.stages)},
                          fsync=fsync)
        os.replace(temporary, path)
        return {"file": path, "prompts": dict(zip(order, counts)), "replayed": replayed,
                "rows": sum(counts), "bytes": os.path.getsize(path), "stage": self.stage, "locations": locations}

    # -- the callers ----------------------------------------------------------

    def submit(self, kind: str, item: Any, timeout: float | None = None) -> Any:
        reply: Future = Future()
        self.queue.put((kind, item, reply))
        return reply.result(timeout=timeout)


_writer: Writer | None = None
_writer_lock = threading.Lock()
# (pipeline stage, stages, whether this rank writes): set when the rank loads its model.
_layout = (0, 1, True)


def configure(stage: int, stages: int, writes: bool) -> None:
    global _layout
    _layout = (stage, stages, writes)


def writer() -> Writer:
    """This process's writer, its thread started on first use."""
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = Writer(*_layout)
        return _writer


def set_staging(mode: str) -> str:
    """This process's extraction staging from now on (``Writer.set_staging``); the rank RPC
    ``nnsight_ray_extract_staging``."""
    return writer().set_staging(mode)


def commit(part: str, timeout: float = 600.0, fsync: bool = False) -> dict[str, Any] | None:
    """Write ``part``'s file once every capture before this call is filed; None on a rank that does not write.

    ``fsync``: flush the file to the disk before it is renamed into place. Without it a
    killed process still leaves only whole files (the rename is atomic, the page cache
    survives the process); with it they also survive the machine's crash, at a third of
    the write speed measured on the GPU host.
    """
    return writer().submit("commit", (part, fsync), timeout)


def discard(part: str) -> None:
    writer().queue.put(("discard", part, None))


def check_locations(locations: list[str], modules: "Sequence[str] | None") -> None:
    """Refuse, before any prompt is sent, a location extraction cannot keep: not a module's ``.output``,
    or (when the model's module paths are known) a module the model does not have."""
    from ...errors import RequestError
    from ..blocks.module_paths import missing_module

    if not locations:
        raise RequestError("extraction needs at least one location, such as 'model.layers.0.output'")
    for location in locations:
        path, _, attribute = str(location).rpartition(".")
        if attribute != "output" or not path:
            raise RequestError(f"extraction keeps module outputs: {location!r} is not '<module>.output' "
                               "(a trace reads anything else)")
        problem = missing_module(modules, path) if modules is not None else None
        if problem is not None:
            raise RequestError(f"extraction location {location!r}: {problem}")


class ExtractTapsInterleaver:
    """Behaviour added to the rank's interleaver on a tapped engine whose requests keep their generated
    tokens' rows: a tap replayed in a breakable graph hands them over too, once the blocks (if any) are
    done with it, as a module's forward hook does on an eager step. Installed by ``extend`` when first needed."""

    nnsight_ray_extract_tap: Any = None

    def replay(self, location: str, live: Any) -> None:
        super().replay(location, live)  # type: ignore[misc]
        tap = self.nnsight_ray_extract_tap
        if tap is not None and self.interleaving:  # type: ignore[attr-defined]
            tap(location, live)


class ExtractRunnerMixin:
    """Runner mixin: captures the rows of requests that ask for extraction (module docstring)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        pp = get_pp_group()
        self._extract_writes = get_tensor_model_parallel_rank() == 0
        configure(pp.rank_in_group, pp.world_size, self._extract_writes)
        self._extract_hooks: dict[str, Any] = {}
        self._extract_takes: dict[str, Any] = {}  # location -> what its hook does with the module's output
        self._extract_step: StepCapture | None = None
        self._extract_seen: set[str] = set()
        self._extract_generating: dict[str, dict[str, Any]] = {}  # request id -> its spec, while it generates
        self._extract_stream: Any = None
        self._extract_steps = 0  # steps captured so far (``StepCapture.step``)

    def _update_states(self, scheduler_output: Any) -> Any:
        result = super()._update_states(scheduler_output)  # type: ignore[misc]
        self._extract_step = None
        if self._extract_seen:
            finished = getattr(scheduler_output, "finished_req_ids", None) or ()
            self._extract_seen.difference_update(finished)
            for rid in finished:
                self._extract_generating.pop(rid, None)
        tokens = scheduler_output.num_scheduled_tokens
        # Requests whose generated tokens are recorded too, running in this step (a decode step's row each).
        generating = self._extract_generating
        decoding = generating.keys() & tokens.keys() if generating else set()
        asking = {}
        for data in scheduler_output.scheduled_new_reqs:
            params = data.sampling_params
            spec = (params.extra_args or {}).get(KEY) if params is not None else None
            if spec is None or data.req_id in self._extract_seen:
                continue
            self._extract_seen.add(data.req_id)
            if data.num_computed_tokens == 0 and tokens.get(data.req_id) == len(data.prompt_token_ids or ()):
                asking[data.req_id] = (data, spec)
                if spec.get("generated"):  # on every rank alike: they decide graph steps alike
                    generating[data.req_id] = spec
            else:
                logger.warning("request %s: prompt not whole in one step (%s of %d tokens from %d); not extracted",
                               data.req_id, tokens.get(data.req_id), len(data.prompt_token_ids or ()),
                               data.num_computed_tokens)
        # Every rank alike (not only the writer): what this step needs of a graph engine (``graphs``).
        self.nnsight_ray_extract_need = self._extract_need(bool(asking), decoding)
        if (asking or decoding) and self._extract_writes:
            self._extract_plan(scheduler_output, asking, decoding)
        return result

    def _extract_need(self, prompts: bool, decoding: set[str]) -> str:
        """A prompt's rows are read by forward hooks, which only an eager step runs (``EAGER``); generated
        tokens' rows too, unless every location they ask for is a tap of this graph engine: then at the
        taps of a breakable graph (``PIECEWISE``, ``ExtractTapsInterleaver``), never a full one."""
        from ..blocks.graphs import ANY, EAGER, PIECEWISE

        if prompts:
            return EAGER
        if not decoding:
            return ANY
        graph = getattr(self, "_nnsight_ray_graph", None) or {}
        if not (taps := graph.get("taps") if graph.get("graphs") else None):
            return EAGER
        wanted = {loc for rid in decoding for loc in self._extract_generating[rid]["locations"]}
        if any(self._extract_tap_name(loc) not in taps for loc in wanted):
            return EAGER
        interleaver = self.nnsight_model.interleaver  # type: ignore[attr-defined]
        if extend(interleaver, ExtractTapsInterleaver):  # outermost: after the snapshot's replay (``snapshot``)
            interleaver.nnsight_ray_extract_tap = self._extract_at_tap
        return PIECEWISE

    def _extract_at_tap(self, location: str, live: Any) -> None:
        """A tap replayed in a breakable graph (``ExtractTapsInterleaver``): this step's rows of it, if asked."""
        if self._extract_step is None:
            return
        if (take := self._extract_takes.get(self._extract_tap_name(location, back=True))) is not None:
            take(live)

    def _extract_tap_name(self, location: str, back: bool = False) -> str:
        """A location as a tap names it (the envoy's path from the root); ``back``: a tap's name as a location."""
        if not (root := self.nnsight_model.path):  # type: ignore[attr-defined]
            return location
        return location[len(root) + 1:] if back else f"{root}.{location}"

    def _extract_plan(self, scheduler_output: Any, asking: dict[str, tuple[Any, dict]], decoding: set[str]) -> None:
        tokens = scheduler_output.num_scheduled_tokens
        spans: list[tuple[int, int]] = []
        captured = 0
        requests = []
        start = 0
        dtype = None
        states = getattr(self, "requests", {})  # vLLM's per-request state: tokens computed before this step
        for rid in self.input_batch.req_ids:  # the forward's row order (see nnsight's Requests.scope)
            count = tokens.get(rid)
            if count is None:
                continue
            if rid in asking:
                data, spec = asking[rid]
                spans.append((start, count))
                requests.append(StepRequest(rid, captured, count, list(data.prompt_token_ids or []), spec, 0))
                captured += count
                dtype = spec.get("dtype") or dtype
                for location in spec["locations"]:
                    self._extract_hook(location)
            elif rid in decoding and rid in states:
                spec = self._extract_generating[rid]
                # Its tokens' ids are the forward's own input ids (the hook reads them): a decode step's
                # token is the one sampled last step, which with async scheduling only the device holds.
                spans.append((start, count))
                requests.append(StepRequest(rid, captured, count, None, spec, int(states[rid].num_computed_tokens)))
                captured += count
                dtype = spec.get("dtype") or dtype
            start += count
        if requests:
            device = self.device if hasattr(self, "device") else "cpu"
            self._extract_steps += 1
            self._extract_step = StepCapture(row_index(spans, device), requests,
                                             DTYPES.get(dtype) if dtype else None, step=self._extract_steps,
                                             wants_ids=any(r.ids is None for r in requests))
            staging = writer().host.mode
            if torch.device(device).type == "cuda" and staging in ("ring", "pool"):
                largest = self._extract_largest(self._extract_step.dtype)
                locations = len({loc for request in requests for loc in request.spec["locations"]
                                 if self._extract_hooks.get(loc) is not None})
                if staging == "ring":  # RING_MB, or twice the largest step at every asked location if larger
                    writer().host.ensure_ring(max(RING_MB << 20, 2 * largest * locations))
                else:
                    writer().host.ensure_slabs(largest, locations)

    def _extract_largest(self, dtype: torch.dtype | None) -> int:
        """Bytes of the largest capture of one location: every token of a full batch (0 if unknown)."""
        config = getattr(self, "model_config", None)
        scheduler = getattr(self, "scheduler_config", None)
        try:
            hidden = int(config.get_hidden_size())
            tokens = int(scheduler.max_num_batched_tokens)
            return tokens * hidden * (dtype or config.dtype).itemsize
        except (AttributeError, TypeError, ValueError):
            return 0

    def _extract_hook(self, location: str) -> None:
        from .parts import residual_parts

        if location in self._extract_hooks:
            return
        path, _, attribute = location.rpartition(".")
        try:
            module = self.get_model().get_submodule(path)
        except AttributeError:
            module = None
        if module is None or type(module).__name__ == "PPMissingLayer" or attribute != "output":
            self._extract_hooks[location] = None  # another stage's module (or nothing to read here)
            return

        def take(output: Any) -> None:
            step = self._extract_step
            if step is None:
                return
            device_side = residual_parts(output)[0].is_cuda
            into = host_buffer if not device_side and writer().host.mode == "ring" else None
            taken = capture(output, step.rows, step.dtype, into)
            ids = None
            if step.wants_ids and step.ids is None:  # once per step: the decode rows' tokens
                ids = step.ids = self._extract_input_ids(step.rows)
            if device_side:
                # On a side stream: the copy to the host overlaps the next layers' kernels.
                if self._extract_stream is None:
                    self._extract_stream = torch.cuda.Stream()
                side = self._extract_stream
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    host = writer().to_host(taken, step)
                    if ids is not None:
                        step.ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
                        step.ids.copy_(ids, non_blocking=True)
                        ids.record_stream(side)
                taken.record_stream(side)
                taken = host
            step.values[location] = taken

        # An eager step's forward runs the hook; a breakable graph's replay reaches a tap (``_extract_at_tap``).
        self._extract_takes[location] = take
        self._extract_hooks[location] = module.register_forward_hook(lambda _module, _args, output: take(output))

    def _extract_input_ids(self, rows: "torch.Tensor | range") -> torch.Tensor:
        """The step's input token ids at ``rows``, as a copy (vLLM's ``input_ids`` buffer is refilled next step)."""
        buffer = self.input_ids.gpu  # type: ignore[attr-defined]
        if isinstance(rows, range):
            return buffer[rows.start:rows.stop].clone()
        return buffer.index_select(0, rows)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]
        finally:
            step, self._extract_step = self._extract_step, None
            if step is not None and step.values:
                if self._extract_stream is not None:
                    step.event = torch.cuda.Event()
                    step.event.record(self._extract_stream)
                writer().queue.put(("capture", step, None))
