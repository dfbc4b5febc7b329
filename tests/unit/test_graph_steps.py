"""Which way a step runs on a graph engine (``_internal/graphs.py``): the rule, on plain stand-ins for nnsight's mediators."""

from __future__ import annotations

from types import SimpleNamespace

from nnsight.intervention.interleaver import Event, Pending

from nnsight_ray._internal.graphs import ANY, EAGER, PIECEWISE, StepModes, _count_unvisited, step_need

TAPS = frozenset({"model.model.layers.1.output", "model.model.layers.2.output"})
OUTSIDE = frozenset({"model.logits", "model.samples", "model.result"})


def parked(provider, alive=True):
    pending = Pending(Event.VALUE if provider else Event.BARRIER, provider, 0)
    return SimpleNamespace(alive=alive, pending=pending)


def test_no_live_block_lets_vllm_choose_full_graphs():
    assert step_need([], TAPS, OUTSIDE) == ANY
    finished = SimpleNamespace(alive=False, pending=None)  # a prefill read, done before the first decode step
    assert step_need([finished, parked("model.model.layers.3.mlp.output", alive=False)], TAPS, OUTSIDE) == ANY


def test_blocks_parked_only_on_taps_get_piecewise_graphs():
    assert step_need([parked("model.model.layers.1.output"), parked("model.model.layers.2.output")],
                     TAPS, OUTSIDE) == PIECEWISE


def test_a_block_waiting_on_logits_or_samples_needs_no_eager_forward():
    assert step_need([parked("model.logits"), parked("model.samples")], TAPS, OUTSIDE) == ANY
    assert step_need([parked("model.logits"), parked("model.model.layers.1.output")], TAPS, OUTSIDE) == PIECEWISE


def test_one_block_on_an_untapped_location_makes_the_step_eager_for_everyone():
    blocks = [parked("model.model.layers.1.output"), parked("model.model.layers.1.mlp.output"), parked(None)]
    assert step_need(blocks, TAPS, OUTSIDE) == EAGER
    assert step_need([parked(None)], TAPS, OUTSIDE) == EAGER  # a barrier names no location
    assert step_need([parked("model.model.layers.1.output")], frozenset(), OUTSIDE) == EAGER  # no taps: any read


def test_step_modes_are_counted_by_what_ran_and_why():
    modes = StepModes()
    for name, forced in [("FULL", False), ("PIECEWISE", False), ("NONE", True), ("NONE", False), ("FULL", False)]:
        modes.record(SimpleNamespace(name=name), forced)
    assert dict(modes.counts) == {"graph": 2, "piecewise": 1, "eager_for_block": 1, "eager": 1}


def test_a_replayed_step_counts_a_visit_of_every_untapped_module_location():
    interleaver = SimpleNamespace(mediators=[object()], counts={
        "model.model.layers.1.output": 3, "model.model.layers.1.mlp.output": 2, "model.logits": 3})
    _count_unvisited(interleaver, TAPS, OUTSIDE)  # the tap was counted by its replay; logits after the forward
    assert interleaver.counts == {"model.model.layers.1.output": 3, "model.model.layers.1.mlp.output": 3,
                                  "model.logits": 3}
    interleaver.mediators = []
    _count_unvisited(interleaver, TAPS, OUTSIDE)  # no block in the step: nothing counts, as on an eager step
    assert interleaver.counts["model.model.layers.1.mlp.output"] == 3
