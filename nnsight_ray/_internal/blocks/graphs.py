"""CUDA graphs on every step no block needs; nnsight's taps on the steps a block does.

nnsight (0.8.1) has two engines: eager (``enforce_eager=True``: every module's
hook fires on every step, no graphs) and tapped (``taps=[...]``: vLLM's
breakable CUDA graphs, with nnsight's handoff recorded at the taps and nothing
else ever served, even on steps vLLM runs eagerly). An nnsight_ray engine with
``enforce_eager=False`` or ``taps`` chooses per step instead, on each rank,
after the scheduler has placed the step's requests and their blocks have run
up to their first read (``GraphStepsRunnerMixin._determine_batch_execution_and_padding``,
the method vLLM's runner asks which graph, if any, runs the step):

* no scheduled request has a live block (none at all, or every block has
  finished: a prefill read is done before the first decode step) nor an open
  cache: vLLM's own choice, full decode graphs included;
* every live block is parked on a tap, and every location a scheduled
  request's ``tracer.cache()`` keeps is a tap: breakable (piecewise) graphs,
  never a full one (a full graph runs no Python, so no tap fires in it);
* a live block is parked anywhere else (an untapped module, a barrier), a
  cache keeps an untapped location, or a new request asks for extraction
  (``extract``: PyTorch forward hooks): the step runs eagerly and every
  location is served, as on an eager engine.

A cache outlives its block (it records every step until its request ends), so
it is the interleaver's observers that say what it needs, not the block.

Steps vLLM runs eagerly anyway (a batch larger than any graph) serve every
location too, taps or not. At ``pipeline_parallel_size > 1`` no tap is served
from a graph (``served_taps``): a step a block reads in runs eagerly there.
``step_need`` is the rule (unit-tested on the CPU); ``StepModes`` counts which
way each step ran (``RayVLLM.step_modes()``).

What a replayed step cannot do: serve an untapped location a block asks for
*after* a tap within that same step (it was decided before the block got
there). The block is then still parked when its request ends and fails with
nnsight's message for a location a graph never reaches. Declare the location
as a tap, or read it before the tap.

The engine side: ``engine_mode`` turns ``enforce_eager`` / ``taps`` into vLLM
arguments (graphs need ``VLLM_USE_BREAKABLE_CUDAGRAPH=1``: it is what makes
vLLM run its forward without torch.compile, so an eager step runs the hooks,
and what lets a tap be recorded into a graph).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Iterable

from ...errors import RequestError
from .classes import extend
from ..observe.timeline import STEP, Timeline, watch_gc

ANY, PIECEWISE, EAGER = "any", "piecewise", "eager"
TAPS_KEY = "nnsight_ray_taps"  # the tap patterns, in vLLM's additional_config
BREAKABLE_ENV = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
# Served after the forward (``sample_tokens``), so a graph step serves them too.
OUTSIDE_FORWARD = ("logits", "samples", "result")


def engine_env(kwargs: dict[str, Any]) -> dict[str, str]:
    """The environment an engine built from ``kwargs`` (after ``engine_mode``) needs in every process."""
    return dict(BREAKABLE_ENV) if kwargs.get("enforce_eager") is False else {}


def engine_mode(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """vLLM engine arguments for an engine's ``enforce_eager`` / ``taps``, the environment it needs, and why.

    ``taps`` (patterns as nnsight's: ``"model.layers.*.output"``) ride vLLM's
    ``additional_config`` to the ranks, which resolve them on their own module
    tree. Graphs are on with taps or with ``enforce_eager=False``; otherwise
    the engine is eager, as today. Returns ``(kwargs, changed)``; ``engine_env`` the environment.
    """
    kwargs = dict(kwargs)
    taps = list(kwargs.pop("taps", None) or ())
    asked = kwargs.pop("enforce_eager", None)
    if taps and asked:
        raise RequestError(f"enforce_eager=True contradicts taps={taps!r}: taps are served from CUDA graphs. "
                           "Drop one of them.")
    if any(not isinstance(tap, str) for tap in taps):
        raise RequestError(f"taps must be strings such as 'model.layers.*.output', got {taps!r}")
    graphs = bool(taps) or asked is False
    if asked is None and not taps:
        return kwargs, []  # the nnsight default (eager) applies, with its reason (parity.py)
    kwargs["enforce_eager"] = not graphs
    changed = []
    if graphs:
        # A graph engine: vLLM's own cudagraph mode, forward without torch.compile.
        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), TAPS_KEY: taps}
        changed.append("VLLM_USE_BREAKABLE_CUDAGRAPH=1 (graphs without torch.compile, so an eager step runs "
                       "every hook; taps are recorded into the graphs)")
    return kwargs, changed


def served_taps(resolved: frozenset, graphs: bool, stages: int) -> frozenset:
    """The taps a rank serves from breakable graphs: ``resolved`` on a graph engine of one pipeline stage.

    None where no graph replays (a CPU engine: every step is eager and serves every location), and none
    at ``pipeline_parallel_size > 1``: there a step in which a block reads runs eagerly, as with
    ``enforce_eager=False``, since the stages' hand-off of served values (``pipeline``) has not run inside
    a breakable graph on any GPU yet. Taps are accepted there and keep nnsight's meaning (every tapped
    location is served, and an untapped one too); only the breakable-graph speed is not had.
    """
    return resolved if graphs and stages == 1 else frozenset()


def sourced(taps: Iterable[str]) -> dict[str, set[str]]:
    """The modules a tap reaches inside (``{module}.source.{op}.{side}``), each with the operations named."""
    ops: dict[str, set[str]] = {}
    for tap in taps:
        module, inside, rest = tap.partition(".source.")
        if inside:
            ops.setdefault(module, set()).add(rest.rpartition(".")[0])
    return ops


def _under(envoy: Any, path: str) -> Any:
    """The envoy at full ``path`` (``model.model.layers.0.self_attn``) in the tree rooted at ``envoy``."""
    return envoy.get(path[len(envoy.path) + 1:]) if path != envoy.path else envoy


def open_sourced(model: Any, taps: Iterable[str], interleaver: Any = None) -> None:
    """Open the forward of each module a tap reaches inside, with nnsight's ``VLLMInterleaver.instrument``
    (nnsight runs it as its runner builds the tree: on a RayVLLM rank, before our taps arrive); an
    operation the forward lacks raises nnsight's ``ValueError``, which lists the forward's operations.

    ``interleaver``: the rank's own, its taps set. None: a throwaway one over ``taps``, which only checks
    them (the client's meta tree, the batch preflight's), before any rank would fail its load.
    """
    from nnsight.modeling.vllm.interleaver import VLLMInterleaver

    interleaver = interleaver if interleaver is not None else VLLMInterleaver(taps)
    for path in sourced(taps):
        interleaver.instrument(_under(model, path))


def strongest(*needs: str) -> str:
    """The need that asks most of a step: ``EAGER`` over ``PIECEWISE`` over ``ANY``."""
    return max(needs, key=(ANY, PIECEWISE, EAGER).index)


def _pending_provider(mediator: Any) -> Any:
    pending = mediator.pending
    return None if pending is None else pending.provider


def step_need(mediators: Iterable[Any], taps: frozenset, outside: frozenset,
              observed: Iterable[str] = ()) -> str:
    """What this step needs from its graphs, given its requests' blocks (``ANY``, ``PIECEWISE``, ``EAGER``).

    ``outside``: locations served after the forward (logits, samples, the
    result), which a graph step serves as an eager one does. ``observed``: the
    locations the step's caches keep (``tracer.cache()``; the interleaver's
    ``observers``), which must be reached on every step, block or no block.
    """
    need = ANY
    for provider in observed:
        if provider in outside:
            continue
        if provider not in taps:
            return EAGER
        need = PIECEWISE
    for mediator in mediators:
        if not mediator.alive:
            continue
        provider = _pending_provider(mediator)
        if provider is None:  # a barrier, or not parked: nothing to go on
            return EAGER
        if provider in outside:
            continue
        if provider in taps:
            need = PIECEWISE
            continue
        return EAGER
    return need


class StepModes:
    """Per-rank counts of how steps ran: ``graph`` (a full graph), ``piecewise``, ``eager_for_block``
    (eager because a block waited on a location no graph serves), ``eager`` (vLLM's own choice)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        # Each step's start, scheduled tokens and end (``RayVLLM.timeline``).
        self.timeline = Timeline()
        watch_gc()

    def record(self, mode: Any, forced: bool) -> None:
        name = getattr(mode, "name", str(mode))
        key = "eager_for_block" if forced else {"FULL": "graph", "PIECEWISE": "piecewise"}.get(name, "eager")
        self.counts[key] += 1


class _NoFullDispatch:
    """vLLM's cudagraph dispatcher, told not to pick a full graph while ``nnsight_ray_no_full`` is set."""

    nnsight_ray_no_full = False

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        if self.nnsight_ray_no_full:
            from vllm.config import CUDAGraphMode

            kwargs["invalid_modes"] = set(kwargs.get("invalid_modes") or ()) | {CUDAGraphMode.FULL}
        return super().dispatch(*args, **kwargs)  # type: ignore[misc]


class GraphStepsRunnerMixin:
    """Runner mixin: choose per step between vLLM's graphs and an eager forward (see the module doc).

    On an eager engine (cudagraph mode ``NONE``, which every CPU engine is) it only counts steps.
    """

    nnsight_ray_step_modes: StepModes
    _nnsight_ray_graph: dict | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        from vllm.config import CUDAGraphMode

        self.nnsight_ray_step_modes = StepModes()
        model = self.nnsight_model  # type: ignore[attr-defined]
        interleaver = model.interleaver
        patterns = (self.vllm_config.additional_config or {}).get(TAPS_KEY) or ()  # type: ignore[attr-defined]
        stages = self.vllm_config.parallel_config.pipeline_parallel_size  # type: ignore[attr-defined]
        # LocalVLLM's come resolved through nnsight's own route (its ``nnsight_taps``): the interleaver has them.
        resolved = frozenset(getattr(interleaver, "taps", ()))
        if patterns and stages == 1:  # a stage would not find what other stages hold, and serves no tap (served_taps)
            # nnsight's own resolution, on this rank's tree (the client checked the patterns on its meta tree).
            model.taps = tuple(patterns)
            resolved = frozenset(model._resolve_taps(self.get_model()))  # type: ignore[attr-defined]
            interleaver.taps = resolved  # what nnsight's instrument reads
            open_sourced(model, resolved, interleaver)
        mode = self.compilation_config.cudagraph_mode  # type: ignore[attr-defined]
        graphs = mode is not None and mode != CUDAGraphMode.NONE
        if graphs:
            extend(self.cudagraph_dispatcher, _NoFullDispatch)  # type: ignore[attr-defined]
        interleaver.taps = served_taps(resolved, graphs, stages)
        self._nnsight_ray_graph = {
            "graphs": graphs,
            "taps": frozenset(getattr(interleaver, "taps", ())),
            "outside": frozenset(f"{model.path}.{key}" if model.path else key for key in OUTSIDE_FORWARD),
            "in_step": False, "mode": None,
        }

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        graph = self._nnsight_ray_graph
        if graph is None:
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]
        graph["in_step"], graph["mode"] = True, None
        began = time.monotonic()
        try:
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]
        finally:
            graph["in_step"] = False
            tokens = getattr(args[0] if args else kwargs.get("scheduler_output"), "total_num_scheduled_tokens", 0)
            if tokens:  # a paused scheduler's empty steps are no steps
                self.nnsight_ray_step_modes.timeline.mark(STEP, tokens, began)
            if graph["graphs"]:
                interleaver = self.nnsight_model.interleaver  # type: ignore[attr-defined]
                self.cudagraph_dispatcher.nnsight_ray_no_full = False  # type: ignore[attr-defined]
                interleaver.taps = graph["taps"]
                if graph["mode"] is not None and graph["mode"].name != "NONE":
                    _count_unvisited(interleaver, graph["taps"], graph["outside"])

    def _determine_batch_execution_and_padding(self, *args: Any, **kwargs: Any) -> Any:
        graph = self._nnsight_ray_graph
        if graph is None or not graph["in_step"]:  # vLLM's warm-up / capture
            return super()._determine_batch_execution_and_padding(*args, **kwargs)  # type: ignore[misc]
        forced = False
        if graph["graphs"]:
            interleaver = self.nnsight_model.interleaver  # type: ignore[attr-defined]
            # Extraction (``extract``: noted by its mixin's ``_update_states``, earlier in this step) reads a
            # prompt's rows in PyTorch forward hooks, which a replayed graph never runs; generated tokens' rows
            # at taps too, when every location it keeps is one.
            need = strongest(getattr(self, "nnsight_ray_extract_need", ANY),
                             step_need(interleaver.mediators, graph["taps"], graph["outside"], interleaver.observers))
            forced = need == EAGER and not kwargs.get("force_eager")
            if need == EAGER:
                kwargs["force_eager"] = True
            self.cudagraph_dispatcher.nnsight_ray_no_full = need == PIECEWISE  # type: ignore[attr-defined]
        result = super()._determine_batch_execution_and_padding(*args, **kwargs)  # type: ignore[misc]
        mode = graph["mode"] = result[0]
        if graph["graphs"] and mode.name == "NONE":
            # An eager forward serves every location, tapped or not (nnsight's
            # tapped engine skips the others even then).
            self.nnsight_model.interleaver.taps = frozenset()  # type: ignore[attr-defined]
        self.nnsight_ray_step_modes.record(mode, forced)
        return result


def _count_unvisited(interleaver: Any, taps: frozenset, outside: frozenset) -> None:
    """Count a replayed step's visit of every module location it did not reach.

    nnsight matches a block's read to a step by counting visits per location;
    a replayed graph visits only its taps, so a block that reads an untapped
    location on a later (eager) step would otherwise be served a step late.
    """
    if not interleaver.mediators:
        return
    counts = interleaver.counts
    for provider in counts:
        if provider not in taps and provider not in outside:
            counts[provider] += 1
