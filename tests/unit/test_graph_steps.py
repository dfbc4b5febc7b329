"""Which way a step runs on a graph engine (``_internal/blocks/graphs.py``): the rule, on plain stand-ins for nnsight's mediators."""

from __future__ import annotations

from types import SimpleNamespace

from nnsight.intervention.interleaver import Event, Pending

from nnsight_ray._internal.blocks.graphs import (ANY, EAGER, PIECEWISE, StepModes, _count_unvisited, served_taps,
                                          sourced, step_need)

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


def test_taps_are_served_from_graphs_only_on_a_graph_engine_of_one_stage():
    assert served_taps(TAPS, graphs=True, stages=1) == TAPS
    assert served_taps(TAPS, graphs=False, stages=1) == frozenset()  # the CPU build: every step eager
    # PP > 1: no tap is served from a graph, so a block's read makes its step eager, as enforce_eager=False does
    served = served_taps(TAPS, graphs=True, stages=2)
    assert served == frozenset()
    assert step_need([parked("model.model.layers.1.output")], served, OUTSIDE) == EAGER
    assert step_need([parked("model.logits")], served, OUTSIDE) == ANY


def _loaded_rank(mode, stages, patterns=(), nnsight_taps=frozenset()):
    """``GraphStepsRunnerMixin.load_model`` over stand-ins for nnsight's runner (no engine): the taps it leaves."""
    from nnsight.modeling.vllm.interleaver import VLLMInterleaver

    from nnsight_ray._internal.blocks.graphs import TAPS_KEY, GraphStepsRunnerMixin

    class Dispatcher:
        def dispatch(self, *args, **kwargs):
            return kwargs

    class NNsightRunner:
        def load_model(self):
            pass

    class Runner(GraphStepsRunnerMixin, NNsightRunner):
        pass

    runner = Runner()
    # nnsight's runner builds its interleaver with the taps LocalVLLM sends resolved (its own ``nnsight_taps``)
    runner.nnsight_model = SimpleNamespace(path="model", interleaver=VLLMInterleaver(nnsight_taps), taps=(),
                                           _resolve_taps=lambda module: tuple(sorted(TAPS)))
    runner.get_model = lambda: None
    runner.vllm_config = SimpleNamespace(additional_config={TAPS_KEY: list(patterns)} if patterns else {},
                                         parallel_config=SimpleNamespace(pipeline_parallel_size=stages))
    runner.compilation_config = SimpleNamespace(cudagraph_mode=mode)
    runner.cudagraph_dispatcher = Dispatcher()
    runner.load_model()
    return runner._nnsight_ray_graph["taps"], runner.nnsight_model.interleaver.taps


def test_a_rank_keeps_the_taps_of_either_route_on_a_graph_engine_of_one_stage():
    from vllm.config import CUDAGraphMode

    ray_taps = _loaded_rank(CUDAGraphMode.FULL_AND_PIECEWISE, 1, patterns=["model.layers.*.output"])
    local_taps = _loaded_rank(CUDAGraphMode.FULL_AND_PIECEWISE, 1, nnsight_taps=TAPS)  # LocalVLLM: nnsight's route
    assert ray_taps == local_taps == (TAPS, TAPS)
    assert _loaded_rank(CUDAGraphMode.NONE, 1, nnsight_taps=TAPS) == (frozenset(), frozenset())  # the CPU build
    assert _loaded_rank(CUDAGraphMode.FULL_AND_PIECEWISE, 2, nnsight_taps=TAPS) == (frozenset(), frozenset())
    assert _loaded_rank(CUDAGraphMode.FULL_AND_PIECEWISE, 2, patterns=["model.layers.*.output"]) == (
        frozenset(), frozenset())


def test_sourced_taps_name_their_modules_and_operations():
    taps = ["model.model.layers.0.output", "model.model.layers.0.self_attn.source.qkv_split_0.output",
            "model.model.layers.0.self_attn.source.self_o_proj_0.input", "model.model.layers.1.mlp.source.act_0.output"]
    assert sourced(taps) == {"model.model.layers.0.self_attn": {"qkv_split_0", "self_o_proj_0"},
                             "model.model.layers.1.mlp": {"act_0"}}
    assert sourced(["model.model.layers.0.output"]) == {}


def test_a_sourced_tap_must_name_an_operation_of_its_forward():
    import pytest
    import torch
    from nnsight import NNsight

    from nnsight_ray._internal.blocks.graphs import open_sourced

    class Attn(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.layers[0].self_attn = Attn()
    model = NNsight(root)
    open_sourced(model, ["model.layers.0.output", "model.layers.0.self_attn.source.torch_relu_0.output"])
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.source: its forward has no operation 'nope_0'. "
                                         r"Its operations are \['torch_relu_0'"):
        open_sourced(model, ["model.layers.0.self_attn.source.nope_0.output"])


def test_a_block_waiting_on_logits_or_samples_needs_no_eager_forward():
    assert step_need([parked("model.logits"), parked("model.samples")], TAPS, OUTSIDE) == ANY
    assert step_need([parked("model.logits"), parked("model.model.layers.1.output")], TAPS, OUTSIDE) == PIECEWISE


def test_one_block_on_an_untapped_location_makes_the_step_eager_for_everyone():
    blocks = [parked("model.model.layers.1.output"), parked("model.model.layers.1.mlp.output"), parked(None)]
    assert step_need(blocks, TAPS, OUTSIDE) == EAGER
    assert step_need([parked(None)], TAPS, OUTSIDE) == EAGER  # a barrier names no location
    assert step_need([parked("model.model.layers.1.output")], frozenset(), OUTSIDE) == EAGER  # no taps: any read


def test_a_cache_is_served_on_every_step_its_request_runs_whether_or_not_its_block_lives():
    done = SimpleNamespace(alive=False, pending=None)  # the block that opened the cache has finished
    assert step_need([done], TAPS, OUTSIDE, observed=["model.model.layers.1.output"]) == PIECEWISE
    assert step_need([done], TAPS, OUTSIDE, observed=["model.model.layers.1.output",
                                                      "model.model.layers.1.input"]) == EAGER
    assert step_need([done], frozenset(), OUTSIDE, observed=["model.model.layers.1.output"]) == EAGER  # no taps
    assert step_need([done, parked(None)], TAPS, OUTSIDE, observed=["model.model.layers.1.output"]) == EAGER
    assert step_need([done], TAPS, OUTSIDE, observed=["model.logits"]) == ANY


def test_what_a_real_cache_keeps_is_named_as_taps_are():
    """The rule reads nnsight's own routes: a ``tracer.cache()`` of a tapped module, on nnsight's interleaver."""
    import nnsight
    import torch

    from nnsight.intervention.cache import Cache

    net = torch.nn.Sequential()
    net.add_module("layers", torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)]))
    model = nnsight.NNsight(net)
    taps = frozenset({f"{model.layers[1].path}.output"})
    opener = SimpleNamespace(alive=False, pending=None, caches=[Cache(model, modules=[model.layers[1]])])
    interleaver = model.interleaver
    interleaver.mediators = [opener]
    interleaver.reindex()
    try:
        assert step_need(interleaver.mediators, taps, OUTSIDE, interleaver.observers) == PIECEWISE
        opener.caches = [Cache(model, modules=[model.layers[1]], include_inputs=True)]
        interleaver.reindex()
        assert step_need(interleaver.mediators, taps, OUTSIDE, interleaver.observers) == EAGER
    finally:
        interleaver.mediators = []
        interleaver.reindex()


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


def test_the_strongest_need_wins():
    from nnsight_ray._internal.blocks.graphs import strongest

    assert strongest(ANY, PIECEWISE) == PIECEWISE and strongest(EAGER, PIECEWISE, ANY) == EAGER
    assert strongest(ANY, ANY) == ANY


def _extracting_runner(taps, graphs=True):
    """The extraction mixin over nnsight's real tapped interleaver (CPU tensors; no engine)."""
    import torch
    from nnsight.intervention.batching import Batcher
    from nnsight.modeling.vllm.interleaver import VLLMInterleaver

    from nnsight_ray._internal.extract.capture import ExtractRunnerMixin

    interleaver = VLLMInterleaver(taps)
    interleaver.batcher = Batcher(None)
    interleaver.batcher.total = 3
    runner = ExtractRunnerMixin()
    runner.nnsight_model = SimpleNamespace(path="model", interleaver=interleaver)
    runner._nnsight_ray_graph = {"graphs": graphs, "taps": frozenset(taps)}
    runner._extract_generating = {"r0": {"locations": ["model.layers.1.output"]},
                                  "r1": {"locations": ["model.layers.1.output", "model.layers.2.output"]}}
    runner._extract_step = object()
    runner._extract_takes = {}
    return runner, interleaver, torch


def test_generated_rows_at_taps_let_the_step_replay_breakable_graphs():
    runner, _, _ = _extracting_runner(TAPS)
    assert runner._extract_need(False, set()) == ANY
    assert runner._extract_need(True, {"r0"}) == EAGER  # a prompt's rows: forward hooks, an eager step
    assert runner._extract_need(False, {"r0", "r1"}) == PIECEWISE  # every location a tap
    runner._extract_generating["r1"]["locations"].append("model.layers.1.mlp.output")
    assert runner._extract_need(False, {"r0", "r1"}) == EAGER  # one untapped location
    assert runner._extract_need(False, {"r0"}) == PIECEWISE
    assert _extracting_runner(TAPS, graphs=False)[0]._extract_need(False, {"r0"}) == EAGER  # an eager engine


def test_a_replayed_tap_hands_its_rows_to_the_extraction_after_the_blocks():
    runner, interleaver, torch = _extracting_runner(TAPS)
    taken = []
    runner._extract_takes["model.layers.1.output"] = taken.append
    assert runner._extract_need(False, {"r0"}) == PIECEWISE  # installs the replay's extension
    live = (torch.ones(8, 2), torch.zeros(8, 2))  # a graph's buffers: padded past the step's 3 rows
    interleaver.interleaving = True
    interleaver.replay("model.model.layers.1.output", live)
    interleaver.replay("model.model.layers.2.output", live)  # a tap nobody extracts here
    assert len(taken) == 1 and taken[0] is live
    interleaver.interleaving = False  # outside a step (the graph's capture) nothing is taken
    interleaver.replay("model.model.layers.1.output", live)
    runner._extract_step = None  # a step with nothing to extract
    interleaver.interleaving = True
    interleaver.replay("model.model.layers.1.output", live)
    assert len(taken) == 1
