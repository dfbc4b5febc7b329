"""The runner mixins: where the pipeline mechanism meets nnsight's vLLM model runner.

`StageRunnerMixin` sits before nnsight's ``NNsightGPUModelRunner`` in the MRO
(load, adopt blocks, collect); `StageForwardMixin` after it, inside nnsight's
``with interleaver:`` around vLLM's forward (take the previous stage's message
off, catch up, drain, put this stage's message on), and at load between vLLM's
load and nnsight's wrap (vLLM's placeholders take the forwards of the modules
they stand for: ``ownership.lend_forwards``). Both are nnsight's own
behaviour at ``pipeline_parallel_size == 1``: one attribute test per step.
"""

from __future__ import annotations

import logging
import pickle
from typing import TYPE_CHECKING, Any, Optional

from .ghosts import PipelineDependencyError, contains_ghost, ghost_free
from .ownership import (StagePersistentObjects, build_stage_map, counted, forward_templates, lend_forwards,
                        module_tree, own_forwards)
from .serving import StageInterleaver, StageState
from .wire import KEY, KEY_DATA, decode_message, encode_message

if TYPE_CHECKING:
    from nnsight.modeling.vllm.model_runners.GPUModelRunner import Request

logger = logging.getLogger(__name__)


def _exchange(mine: Any) -> list[Any]:
    """Every pipeline stage's ``mine``, in stage order (one collective over the stages, at load)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    gathered: list[Any] = [None] * group.world_size
    dist.all_gather_object(gathered, mine, group=group.cpu_group)
    return gathered


def reported_error(request: "Request", ghosted: bool) -> Optional[dict]:
    """A request's error as this stage should report it (see `StageInterleaver.settle`).

    ``ghosted``: the request's block was served a ghost on this stage.
    """
    if request.error is not None:
        return request.error
    mediator = request.mediator
    error = None if mediator is None else getattr(mediator, "nnsight_error", None)
    if error is None:
        return None
    if ghosted and error.get("type_name") != PipelineDependencyError.__name__:
        return None
    return error


class StageRunnerMixin:
    """Outer runner mixin (before ``NNsightGPUModelRunner`` in the MRO).

    Wraps nnsight's ``load_model`` (install the stage), ``_update_states``
    (adopt new blocks) and ``collect_nnsight`` (every stage reports, ghosts
    filtered). With ``pipeline_parallel_size == 1`` each is nnsight's own.
    """

    nnsight_stage: Optional[StageState] = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        pp = get_pp_group()
        if pp.world_size <= 1:
            return
        model = self.nnsight_model  # type: ignore[attr-defined]
        trees = _exchange(module_tree(model))
        stage_map = build_stage_map(pp.rank_in_group, trees, root=model.path)
        taps = model.interleaver.taps
        stage_map.later = tuple(p for p in stage_map.later if counted(taps, p))
        state = StageState(map=stage_map, tp_size=get_tp_group().world_size)
        StageInterleaver.install(model.interleaver, state)
        objects = StagePersistentObjects(self.nnsight_persistent_objects,  # type: ignore[attr-defined]
                                         forward_templates((e.path, e._module) for e in model.modules()))
        for path in stage_map.missing:
            if f"Module:{path}" not in dict.keys(objects):
                objects[f"Module:{path}"] = objects.stand_in(path)
        self.nnsight_persistent_objects = objects
        self.nnsight_stage = state
        logger.info(
            "pipeline stage %d/%d: %d locations owned here, %d on later stages, %d modules stubbed",
            stage_map.stage,
            stage_map.num_stages,
            sum(1 for s in stage_map.owner.values() if s == stage_map.stage),
            len(stage_map.later),
            len(stage_map.missing),
        )

    def _update_states(self, scheduler_output: Any) -> None:
        super()._update_states(scheduler_output)  # type: ignore[misc]
        if self.nnsight_stage is None:
            return
        stage = self.nnsight_stage
        requests = self.nnsight_requests.requests  # type: ignore[attr-defined]
        for request in requests.values():
            if request.mediator is not None:
                stage.adopt(request.mediator, (request.id, ""))
            for registration_id, copy in request.copies.items():
                stage.adopt(copy, (request.id, registration_id))
        ended = stage.ended
        if ended:  # requests dropped without a collect (aborted) leave nothing behind
            for key in [key for key in ended if key[0] not in requests]:
                del ended[key]

    def collect_nnsight(
        self,
        request_ids: list[str],
        finished_request_ids: Optional[list[str]] = None,
        outputs: Optional[dict] = None,
    ) -> Optional[bytes]:
        if self.nnsight_stage is None:
            return super().collect_nnsight(request_ids, finished_request_ids, outputs)  # type: ignore[misc]
        from vllm.distributed.parallel_state import get_tp_group

        from ..merge.payload import collect_serializer

        stage = self.nnsight_stage
        requests = self.nnsight_requests  # type: ignore[attr-defined]
        finished = set(finished_request_ids or [])
        wanted = set(request_ids) | finished
        if finished:
            requests.harvest(finished)
        tracked = []
        for request in requests.requests.values():
            if not request.named(wanted):
                continue
            tracked.append((request, request.key(wanted)))
            if request.named(finished):
                stage.forget(request.id)
            for taken in request.harvested.values():
                taken["saves"] = ghost_free(taken["saves"])
            mediator = request.mediator
            saved = getattr(mediator, "nnsight_saved", None)
            if saved:
                mediator.nnsight_saved = {
                    name for name in saved if contains_ghost(mediator.lcls.get(name)) is None
                }
            pending = None if mediator is None else mediator.pending
            if (
                request.named(finished)
                and stage.ghosted(mediator)
                and mediator.alive
                and pending is not None
                and pending.provider != "result"
            ):
                # Unwound here, before nnsight's collect would report it: a copy
                # that ran on ghosts may well be parked where the real run is not.
                requests.finish_dangling(mediator, self.nnsight_model.interleaver.taps)  # type: ignore[attr-defined]
        payload = super().collect_nnsight(request_ids, finished_request_ids, outputs)  # type: ignore[misc]
        if get_tp_group().rank_in_group != 0:
            return payload
        # Every stage reports its trace's values (nnsight: global rank 0 only),
        # with any name that holds a ghost left to the stage that has it.
        # nnsight pickles the dict (with what `payload.collect_serializer()` names), except inside
        # `payload.unserialized()`.
        serialized = isinstance(payload, bytes)
        collected = (pickle.loads(payload) if serialized else payload) or {}
        for request, (engine_id, index) in tracked:
            ghosted = stage.ghosted(request.mediator)
            entry = collected.setdefault(engine_id, {"saves": {}, "error": None, "registered": {}, "sequences": {}})
            sequence = entry["sequences"].setdefault(index, {"saves": {}, "registered": {}})
            sequence["saves"] = ghost_free(request.saves())
            if entry["error"] is None or entry["error"] is request.deferred():
                entry["error"] = reported_error(request, ghosted)
        for entry in collected.values():
            primary = entry["sequences"].get(0)
            if primary is not None:
                entry["saves"], entry["registered"] = primary["saves"], primary["registered"]
        return collect_serializer()(collected) if serialized else collected


class StageForwardMixin:
    """Inner runner mixin (after ``NNsightGPUModelRunner``): runs inside its ``with interleaver``.

    Takes the previous stage's recordings off the incoming
    ``IntermediateTensors`` before vLLM sees them, drains the later stages'
    locations once the forward is done, and puts this stage's recordings on
    the outgoing ``IntermediateTensors``.
    """

    nnsight_stage: Optional[StageState] = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's load; then, at PP > 1 and before nnsight wraps the model, vLLM's placeholders take the
        forwards of the modules they stand for (``lend_forwards``; one collective for the other stages')."""
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        if self.vllm_config.parallel_config.pipeline_parallel_size > 1:  # type: ignore[attr-defined]
            model = self.get_model()  # type: ignore[attr-defined]
            lent = lend_forwards(model, _exchange(own_forwards(model)))
            logger.debug("pipeline stage: %d placeholders show their place's forward", len(lent))

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        stage = self.nnsight_stage
        if stage is None:
            return super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        message = None
        if intermediate_tensors is not None:
            tensors = intermediate_tensors.tensors
            packed, data = tensors.pop(KEY, None), tensors.pop(KEY_DATA, None)
            if packed is not None:
                message = decode_message(packed, data)
        step = stage.begin(message)
        output = super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        interleaver = self.nnsight_model.interleaver  # type: ignore[attr-defined]
        if not step.caught_up:
            interleaver.catch_up()
        if stage.map.is_last:
            return output
        interleaver.drain()
        interleaver.settle()
        if step.busy and output is not None and hasattr(output, "tensors"):
            output.tensors.update(encode_message(stage.outgoing(), stage.tp_size))
        return output
