"""Serving a stage's blocks: own locations through nnsight's handoff, earlier ones replayed, later ones ghosted.

Every event a block is served on a stage goes through one loop, `serve`:
nnsight's own ``Mediator.handle`` loop (relax a pinned step, answer each event
parked on this visit, until the block parks elsewhere or ends), with what
answers a read or applies a write handed in. The three places that serve
blocks differ only in that: own locations (`StageMediator.handle`: the real
value, recorded for the next stage), earlier stages' locations
(`StageInterleaver.catch_up`: what the owning stage recorded) and later
stages' locations (`StageInterleaver.drain`: ghosts).

What the pipeline keeps about a block (its key, the location it was last
served, whether it was served a ghost) lives in its `Block`, kept by the
stage's `StageState`, and what it keeps about the step in flight in one
`Step`: nothing is set on nnsight's mediators beyond the class swap to
`StageMediator` (as nnsight swaps its runner class).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from greenlet import getcurrent
from nnsight.intervention.interleaver import Event, Mediator
from nnsight.util import apply

from .ghosts import SLOT, Ghost, PipelineDependencyError, Slot, contains_ghost
from .ownership import LOCAL, StageMap, counted
from .wire import WRITTEN, StageMessage, Unsendable

#: The key of a block not adopted by a stage (no request known yet).
NO_KEY = ("", "")


@dataclass
class Block:
    """What a stage keeps about one block (one request's trace, or one registered copy).

    Attributes:
        key: ``(request id, registration id)``: the same on every stage, so
            recordings and reasons travel under it.
        last: The location this block was last served on this stage (messages).
        ghosted: Served a ghost at some point: what it computed since is not
            this stage's to report.
        noted: Its end was noted this step (`StageInterleaver.settle`).
    """

    key: tuple = NO_KEY
    last: Optional[str] = None
    ghosted: bool = False
    noted: bool = False


@dataclass
class Step:
    """One forward step on one stage: what came in, and what goes out."""

    #: The previous stage's message for this step, until the catch-up consumes it.
    inbox: Optional[StageMessage] = None
    caught_up: bool = True
    #: This step's outgoing order and recordings (non-last stages only).
    order: list = field(default_factory=list)
    values: dict = field(default_factory=dict)
    #: Whether this stage served any block this step (else nothing is sent).
    busy: bool = False


@dataclass
class StageState:
    """One stage's pipeline bookkeeping: its map, the step in flight and every block's `Block`."""

    map: StageMap
    tp_size: int = 1
    step: Step = field(default_factory=Step)
    #: The last order earlier stages sent: locations are the same every step,
    #: so a step whose earlier stages had no live block to report replays it.
    last_order: Optional[list] = None
    #: Block key -> why its copy on this or an earlier stage ended, kept
    #: until its request is collected (see `StageInterleaver._missing`).
    ended: dict = field(default_factory=dict)
    #: Structure of own values that later locations copy (see `StageMap.templates`).
    shapes: dict = field(default_factory=dict)
    #: Mediator -> its `Block`; an entry goes with its mediator.
    blocks: "weakref.WeakKeyDictionary[Mediator, Block]" = field(default_factory=weakref.WeakKeyDictionary)

    def begin(self, message: Optional[StageMessage]) -> Step:
        """Start a step, with what the previous stage sent (None on the first stage)."""
        self.step = Step(inbox=message, caught_up=self.map.stage == 0)
        if message is not None:
            self.ended.update(message.stopped)
            self.last_order = message.order
        return self.step

    def forget(self, request_id: str) -> None:
        """Drop what is kept about a collected request's blocks."""
        for key in [key for key in self.ended if key[0] == request_id]:
            del self.ended[key]

    def adopt(self, mediator: Mediator, key: tuple) -> None:
        """Serve ``mediator`` as a block of this stage, under ``key`` (once; later calls keep the first key)."""
        if mediator not in self.blocks:
            self.blocks[mediator] = Block(key)
        if not isinstance(mediator, StageMediator):
            mediator.__class__ = StageMediator

    def block(self, mediator: Mediator) -> Block:
        found = self.blocks.get(mediator)
        if found is None:
            found = self.blocks[mediator] = Block()
        return found

    def last_location(self, mediator: Any) -> Optional[str]:
        found = self.blocks.get(mediator)
        return None if found is None else found.last

    def ghosted(self, mediator: Any) -> bool:
        found = None if mediator is None else self.blocks.get(mediator)
        return found is not None and found.ghosted

    def record(self, block: Block, provider: str, occurrence: int, served: Any) -> None:
        """Note one event a block had served at an own location: the value it read, or `WRITTEN`."""
        key = (block.key, self.map.code(provider), occurrence)
        self.step.values.setdefault(key, []).append(served if served is WRITTEN else _clone(served))

    def ghost_for(self, provider: str, owner: int) -> Any:
        shape = self.shapes.get(self.map.templates.get(provider, ""))
        here = self.map.stage
        if shape is None:
            return Ghost.make(provider, owner, here)
        return apply(shape, lambda _: Ghost.make(provider, owner, here), Slot)

    def outgoing(self) -> StageMessage:
        inbox = self.step.inbox or StageMessage()
        values = dict(inbox.values)
        values.update(self.step.values)
        return StageMessage(order=list(inbox.order) + self.step.order, values=values, stopped=dict(self.ended))


# ---------------------------------------------------------------------------
# The one serving loop
# ---------------------------------------------------------------------------


class Refuse(Exception):
    """Raised by a `serve` answer: throw ``error`` into the block at its park instead of answering."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def serve(
    mediator: Mediator,
    provider: str,
    occurrence: int,
    read: Callable[[Any], Any],
    write: Callable[[Any], None],
) -> None:
    """Serve every event ``mediator`` parks on this visit (``occurrence``) of ``provider``.

    nnsight's ``Mediator.handle`` loop, with the policy handed in: ``read(pending)``
    is the value a read (``Event.VALUE``) is answered with, ``write(pending)``
    takes a swap or skip; either may raise `Refuse`. An error the block raises
    propagates, as from nnsight's loop.
    """
    pending = mediator.pending
    while pending is not None and pending.provider == provider and pending.iteration == occurrence:
        if mediator.iteration:  # first hit of a pinned step: follow the model from here (nnsight)
            mediator.iteration = None
        try:
            if pending.event is Event.VALUE:
                answer: tuple = (read(pending),)
            else:
                write(pending)
                answer = ()
        except Refuse as refusal:
            mediator.pending = _throw(mediator, refusal.error)
        else:
            mediator.pending = mediator.switch(*answer)
        pending = mediator.pending


def _throw(mediator: Mediator, error: BaseException) -> Any:
    """Raise ``error`` inside the block at its current park; return where it parks next."""
    worker = mediator.worker
    worker.parent = getcurrent()
    try:
        return worker.throw(error)
    except BaseException as exception:
        if not hasattr(exception, "__intervention_tb__"):
            exception.__intervention_tb__ = exception.__traceback__
        raise


def _clone(value: Any) -> Any:
    return apply(value, lambda t: t.detach().clone(), torch.Tensor)


def _defer(mediator: Mediator, exception: BaseException) -> None:
    """Record a block's exception the way nnsight's deferring interleaver does."""
    mediator.exception = exception
    mediator.pending = None


def _describe(exception: BaseException) -> str:
    return f"{type(exception).__name__}: {exception}"


# ---------------------------------------------------------------------------
# Own locations
# ---------------------------------------------------------------------------


class StageMediator(Mediator):
    """A block on a pipeline stage: records what it reads, refuses swaps of ghosts.

    Installed on every block the runner carries (a class swap, by
    `StageState.adopt`) once it is known which request and registration it
    belongs to. `handle` serves nnsight's way, plus two things: each value
    served is recorded for the next stage, and a swap or skip whose
    replacement holds a `Ghost` is refused inside the block.
    """

    def handle(self, provider: str, value: Any) -> Any:
        stage: Optional[StageState] = getattr(self.interleaver, "nnsight_stage", None)
        if stage is None or stage.map.is_last:
            return super().handle(provider, value)
        pending = self.pending
        if pending is None or pending.provider != provider:
            return value
        occurrence = self.occurrence(provider)
        batcher = self.interleaver.batcher
        block = stage.block(self)

        def read(pending: Any) -> Any:
            served = value if batcher is None else batcher.narrow(value, self.batch_group)
            stage.record(block, provider, occurrence, served)
            block.last = provider
            return served

        def write(pending: Any) -> None:
            nonlocal value
            ghost = contains_ghost(pending.value)
            if ghost is not None:
                raise Refuse(PipelineDependencyError(
                    f"the value written to {provider} on pipeline stage {stage.map.stage} depends "
                    f"on {ghost.origin}, which pipeline stage {ghost.owner} computes later in the "
                    "forward: not supported under pipeline parallelism."
                ))
            if batcher is None:
                value = pending.value
            elif pending.event is Event.SWAP:
                value = batcher.widen(value, self.batch_group, pending.value)
            else:
                value = batcher.gather_skip(value, self.batch_group, pending.value)
            stage.record(block, provider, occurrence, WRITTEN)

        serve(self, provider, occurrence, read, write)
        return value


_STAGE_CLASSES: dict[type, type] = {}


class StageInterleaver:
    """Behaviour added to nnsight's ``VLLMInterleaver`` on a pipeline stage.

    Installed by class swap (`install`) so the envoy tree and every module
    controller keep pointing at the same interleaver object. `handle` serves
    this stage's own locations through nnsight's handoff and lets the other
    stages' locations that also fire here (a spanning container's handoffs)
    pass through untouched; `catch_up` and `drain` serve the other stages'
    locations at their place in the forward.
    """

    nnsight_stage: StageState

    @staticmethod
    def install(interleaver: Any, state: StageState) -> None:
        base = type(interleaver)
        cls = _STAGE_CLASSES.get(base)
        if cls is None:
            cls = _STAGE_CLASSES[base] = type(f"Stage{base.__name__}", (StageInterleaver, base), {})
        interleaver.__class__ = cls
        interleaver.nnsight_stage = state

    def handle(self, provider: str, value: Any) -> Any:
        stage = self.nnsight_stage
        if not stage.step.caught_up:
            self.catch_up()
        owner = stage.map.owner_of(provider)
        if owner == stage.map.stage or owner == LOCAL:
            if owner != LOCAL and not stage.map.is_last and counted(self.taps, provider):
                stage.step.busy = True
                stage.step.order.append(stage.map.code(provider))
                if provider in stage.map.template_sources and provider not in stage.shapes:
                    stage.shapes[provider] = apply(value, lambda _: SLOT, torch.Tensor)
            return super().handle(provider, value)  # type: ignore[misc]
        return value

    # -- earlier stages ------------------------------------------------------

    def catch_up(self) -> None:
        """Replay every location earlier stages handled this step, in their order."""
        stage = self.nnsight_stage
        step = stage.step
        step.caught_up = True
        if not self.mediators:
            return
        step.busy = True
        message = step.inbox
        if message is None:
            # The earlier stages had no live block this step (their copies
            # ended): nothing was recorded, but the locations still passed.
            if stage.last_order is None:
                for mediator in list(self.mediators):
                    pending = mediator.pending
                    if pending is not None and pending.provider is not None:
                        owner = stage.map.owner_of(pending.provider)
                        if 0 <= owner < stage.map.stage:
                            occurrence = mediator.occurrence(pending.provider)
                            try:
                                read = pending.event is Event.VALUE
                                mediator.pending = _throw(mediator, self._missing(mediator, pending.provider, occurrence, None, read))
                            except Exception as exception:
                                _defer(mediator, exception)
                self._reindex_parked()
                return
            message = step.inbox = StageMessage(order=stage.last_order)
        for code in message.order:
            provider = stage.map.name(code)
            if provider in self.parked:
                served = False
                while ready := self._ready(provider):
                    served = True
                    for mediator in ready:
                        self._serve_recorded(mediator, provider, message)
                if served:
                    self._reindex_parked()
            self.counts[provider] = self.counts.get(provider, 0) + 1

    def _serve_recorded(self, mediator: Mediator, provider: str, message: StageMessage) -> None:
        """Serve ``mediator`` what the owning stage served its copy at this visit of ``provider``."""
        stage = self.nnsight_stage
        block = stage.block(mediator)
        occurrence = mediator.occurrence(provider)
        values = message.values.get((block.key, stage.map.code(provider), occurrence), ())
        taken = 0

        def replay(pending: Any) -> Any:
            nonlocal taken
            entry = values[taken] if taken < len(values) else None
            read = pending.event is Event.VALUE
            if entry is None or isinstance(entry, Unsendable) or (entry is WRITTEN) == read:
                raise Refuse(self._missing(mediator, provider, occurrence, entry, read))
            taken += 1
            if read:
                block.last = provider
                return entry
            return None  # the owning stage applied the write; nothing to do here

        try:
            serve(mediator, provider, occurrence, replay, replay)
        except Exception as exception:
            _defer(mediator, exception)

    def _missing(self, mediator: Mediator, provider: str, occurrence: int, entry: Any, read: bool) -> BaseException:
        """The error for a block whose copy on the owning stage did not do what this copy does."""
        stage = self.nnsight_stage
        owner = stage.map.owner_of(provider)
        what = f"the value of {provider} that pipeline stage {owner} served" if read else f"the write to {provider} that pipeline stage {owner} applied for"
        if isinstance(entry, Unsendable):
            why = f"it could not be sent between stages ({entry.reason})"
        else:
            stopped = stage.ended.get(stage.block(mediator).key)
            why = (
                f"that stage's copy of this block had already ended ({stopped})"
                if stopped
                else "that stage's copy of this block took another path there"
            )
        return PipelineDependencyError(
            f"pipeline stage {stage.map.stage} needs {what} this block at step {occurrence}, but {why}. "
            "A block whose control flow depends on a value computed later in the forward cannot run under "
            "pipeline parallelism."
        )

    # -- later stages ----------------------------------------------------------

    def drain(self) -> None:
        """Serve ghosts for the later stages' locations of this step, then count them."""
        stage = self.nnsight_stage
        if not self.mediators:
            return
        stage.step.busy = True
        progressed = True
        while progressed:
            progressed = False
            for mediator in list(self.mediators):
                pending = mediator.pending
                if pending is None or pending.provider is None:
                    continue
                provider = pending.provider
                owner = stage.map.owner_of(provider)
                if owner <= stage.map.stage or pending.iteration != mediator.occurrence(provider):
                    continue
                progressed = True
                self._serve_ghost(mediator, provider, owner)
        counts = self.counts
        for provider in stage.map.later:
            counts[provider] = counts.get(provider, 0) + 1
        self._reindex_parked()

    def _serve_ghost(self, mediator: Mediator, provider: str, owner: int) -> None:
        stage = self.nnsight_stage
        block = stage.block(mediator)

        def read(pending: Any) -> Any:
            block.ghosted = True
            return stage.ghost_for(provider, owner)

        def write(pending: Any) -> None:
            """The owning stage applies it."""

        try:
            serve(mediator, provider, mediator.occurrence(provider), read, write)
        except Exception as exception:
            _defer(mediator, exception)

    def settle(self) -> None:
        """Note every block that ended this step; drop errors a ghost may have caused.

        The reason travels to the next stages (see `StageInterleaver._missing`).
        A copy that had been served a ghost ran on placeholders, so its error is
        not this stage's to report: the owning stage ran the same code on real
        values and reports whatever really happens. A `PipelineDependencyError`
        is kept: it is the construct itself that cannot run.
        """
        stage = self.nnsight_stage
        for mediator in self.mediators:
            exception = mediator.exception
            if exception is None:
                continue
            block = stage.block(mediator)
            if block.noted:
                continue
            block.noted = True
            stage.ended[block.key] = f"on stage {stage.map.stage}: {_describe(exception)}"
            if block.ghosted and not isinstance(exception, PipelineDependencyError):
                mediator.exception = None
