"""Run a trace written against the whole model on an engine split into pipeline stages.

Problem (nnsight 0.8.1, vLLM 0.32): under pipeline parallelism each stage holds
only its own slice of the model. The client writes a block against the *full*
module tree, nnsight ships the same block to every rank, and every rank runs it
as a greenlet beside its own forward. On stage 0 the later layers are vLLM
``PPMissingLayer`` placeholders that are never called, so a block that reads
``model.model.layers[3].output`` waits there forever; on stage 1 the early
layers never run; the block's references to modules a stage lacks do not even
deserialize; and nnsight reports a trace's saves only from pipeline rank 0.

Design: every stage runs its own copy of every block (as nnsight already does),
and each copy is driven through the *whole* forward, in order, with values
taken from wherever they really exist:

* **Ownership.** At load the stages exchange their module trees (one
  ``all_gather_object`` over the pipeline group), so each knows the full tree
  and which stage runs each location: a module's ``.input``/``.skip``/
  ``.output`` belong to the stage that holds it; a container that spans
  stages (the root, ``model.model``) has its input on the first stage that
  runs it and its output on the last; ``model.logits`` / ``model.samples``
  belong to the last stage (`StageMap`). Modules a stage lacks get stand-in
  modules in the runner's persistent-object map, so any block deserializes.
* **Own locations** are served by nnsight's own interleaver, unchanged, except
  that each value handed to a block is also *recorded* (a clone, keyed by
  request, block, location and the block's own occurrence count of it).
* **Earlier stages' locations** are replayed at the start of the stage's step
  ("catch-up"), in the exact order the earlier stages handled them: each
  parked block is served the value *that stage served it*. The recordings and
  that order ride to the next stage inside the ``IntermediateTensors`` vLLM
  already sends between stages (two extra uint8 tensors, `wire.KEY`), and each stage
  forwards what it received, so stage 2 sees stage 0's values too. A block on a
  later stage therefore reads an earlier stage's value — the cross-stage
  dependency ``layers[3].output[0][:] += layers[1].output[0]`` — with no extra
  round trip: the pull is the send the pipeline already makes, taken in the same
  receive as the hidden states.
* **Later stages' locations** are served *ghosts* (`Ghost`) once the stage's own
  forward is done ("drain"): tensors with no data whose every operation yields
  another ghost, so the copy keeps its control flow and goes on to its next
  step. Whatever the copy computes from a ghost is discarded; the stage that
  owns the location runs its own copy with the real value. Writing a ghost
  into a real tensor, or swapping one into the model, is a use of a later
  stage's value on an earlier stage and raises `PipelineDependencyError`;
  turning one into a Python value (``bool``, ``.item()``) stops that copy
  quietly (`GhostStop`), and a later stage that then misses a value that copy
  would have recorded reports which location, step and stage.
* **Counts.** nnsight matches a read to a visit by per-location counts. Every
  location is counted exactly once per visit on every stage (own ones as they
  fire, earlier ones in the catch-up, later ones after the drain), so a
  ``tracer.iter[...]`` step means the same visit on every stage.
* **Collection.** Every stage's first tensor-parallel rank reports its trace
  saves and errors (nnsight reports only global rank 0's); a name whose value
  holds a ghost is dropped, and an error a copy raised after it had been served
  a ghost is dropped too, since the owning stage ran the same code on real
  values. ``merge_collected`` then unions the stages.


Layout (each module one concern; the pure ones are unit-tested without an engine):

* `ghosts` — `Ghost`, `GhostStop`, `PipelineDependencyError`, `contains_ghost`.
* `ownership` — `StageMap` and `build_stage_map` (pure), stand-in modules for
  what other stages hold.
* `wire` — `StageMessage` and its encoding into ``IntermediateTensors``.
* `serving` — serving a stage's blocks: `StageState` (a `Block` per block, a
  `Step` per forward step), `StageMediator`, `StageInterleaver`, and `serve`,
  the one loop every event goes through (nnsight's ``Mediator.handle`` loop
  with the answer handed in).
* `runner` — the runner mixins.

Everything here is installed by the runner classes (`StageRunnerMixin`,
`StageForwardMixin`) only when ``pipeline_parallel_size > 1``; at ``pp=1`` the
runner pays one attribute test per step.
"""

from .ghosts import Ghost, GhostStop, PipelineDependencyError, contains_ghost
from .ownership import LOCAL, StageMap, build_stage_map
from .runner import StageForwardMixin, StageRunnerMixin
from .serving import Block, StageInterleaver, StageMediator, StageState, Step
from .wire import KEY, KEY_DATA, WRITTEN, StageMessage, decode_message, encode_message

__all__ = [
    "Block",
    "Step",
    "KEY",
    "KEY_DATA",
    "LOCAL",
    "WRITTEN",
    "Ghost",
    "GhostStop",
    "PipelineDependencyError",
    "StageMap",
    "StageMediator",
    "StageMessage",
    "StageInterleaver",
    "StageRunnerMixin",
    "StageForwardMixin",
    "StageState",
    "build_stage_map",
    "contains_ghost",
    "decode_message",
    "encode_message",
]
