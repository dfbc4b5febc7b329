"""Pipeline-stage mechanism (``nnsight_ray._internal.pipeline``): pure logic, no Ray, no engine.

Covers the three pieces the engine tests cannot isolate: ghost semantics,
location ownership worked out from per-stage module trees (with vLLM's real
``PPMissingLayer``), and the record -> send -> replay path between two stages,
driven with real nnsight mediators over a hand-fed forward.
"""

from __future__ import annotations

import pickle
import weakref
from types import SimpleNamespace

import pytest
import torch
from greenlet import greenlet

from nnsight.intervention.interleaver import EarlyStopException

from nnsight_ray._internal import pipeline as pp
from nnsight_ray._internal.pipeline import (
    Block,
    LOCAL,
    WRITTEN,
    Ghost,
    GhostStop,
    PipelineDependencyError,
    StageMessage,
    build_stage_map,
    contains_ghost,
    decode_message,
    encode_message,
)
from nnsight_ray._internal.pipeline.ghosts import ghost_free
from nnsight_ray._internal.pipeline.ownership import StagePersistentObjects, StageStub
from nnsight_ray._internal.pipeline.runner import reported_error
from nnsight_ray._internal.pipeline.wire import Unsendable


def in_block(fn):
    """Run ``fn`` the way a block runs: in a greenlet that names a mediator."""
    stage = SimpleNamespace(last_location=lambda mediator: "model.model.layers.0.output")
    holder = type("M", (), {"interleaver": SimpleNamespace(nnsight_stage=stage)})()
    box = {}

    def body():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    worker = greenlet(body)
    worker.mediator = weakref.ref(holder)
    worker.switch()
    if "error" in box:
        raise box["error"]
    return box["value"]


# --- ghosts ------------------------------------------------------------------


def ghost() -> Ghost:
    return Ghost.make("model.model.layers.3.output", owner=1, here=0)


def test_ghost_ops_stay_ghosts():
    def body():
        g = ghost()
        real = torch.ones(4, 3)
        results = [g[0], g + 1, real + g, g.clone(), g.detach().cpu(), torch.cat([real, g]), g @ real, g.shape, g.sum(-1)]
        return results, real.clone(), g.dtype, g.device

    results, real, dtype, device = in_block(body)
    assert all(isinstance(r, Ghost) for r in results)
    assert all(r.origin == "model.model.layers.3.output" and r.owner == 1 for r in results)
    assert dtype == torch.float32 and device.type == "cpu"


def test_ghost_save_marks_it():
    from nnsight.tracing.tracer import _saves, mark

    g = in_block(lambda: mark(ghost()[0] * 2))
    assert isinstance(g, Ghost) and id(g) in _saves()
    _saves().discard(id(g))


@pytest.mark.parametrize("convert", [bool, float, int, len, lambda g: g.item(), lambda g: g.tolist(), lambda g: list(g)])
def test_ghost_to_python_value_stops_quietly(convert):
    with pytest.raises(GhostStop, match="layers.3.output.*stage 1"):
        in_block(lambda: convert(ghost().sum()))
    assert issubclass(GhostStop, EarlyStopException)


def test_writing_a_ghost_into_a_real_tensor_is_a_dependency_error():
    def add_into_real():
        real = torch.zeros(3)
        real[:] += ghost()[0]

    with pytest.raises(PipelineDependencyError, match="edit of model.model.layers.0.output on pipeline stage 0 depends on model.model.layers.3.output"):
        in_block(add_into_real)
    with pytest.raises(PipelineDependencyError):
        in_block(lambda: torch.zeros(3).copy_(ghost()))
    with pytest.raises(PipelineDependencyError):
        in_block(lambda: torch.add(torch.ones(3), ghost(), out=torch.zeros(3)))


def test_writing_into_a_ghost_is_a_no_op():
    def body():
        g = ghost()
        g[:] = torch.ones(3)
        g += torch.ones(3)
        return g.mul_(2)

    assert isinstance(in_block(body), Ghost)


def test_ghost_outside_a_block_is_its_empty_tensor():
    g = ghost()
    assert g.numel() == 0 and list(g) == []
    assert "layers.3.output" in repr(g)
    back = pickle.loads(pickle.dumps(g))
    assert isinstance(back, Ghost) and back.origin == g.origin


def test_contains_ghost_finds_nested():
    g = ghost()
    assert contains_ghost([torch.ones(1), {"a": (1, g)}]) is g
    assert contains_ghost({"a": [torch.ones(1)], "b": None}) is None
    holder = type("Holder", (), {})()
    holder.value = g
    assert contains_ghost(holder) is g


# --- ownership ---------------------------------------------------------------


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = torch.nn.Linear(2, 2)
        self.mlp = torch.nn.Linear(2, 2)


def _stage_tree(stage: int, num_stages: int = 2, num_layers: int = 4) -> dict[str, bool]:
    """The module tree vLLM builds for ``stage`` (the llama layout), as nnsight paths."""
    from vllm.model_executor.models.utils import PPMissingLayer

    first, last = stage == 0, stage == num_stages - 1
    per = num_layers // num_stages
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(4, 2) if first else PPMissingLayer()
    model.model.layers = torch.nn.ModuleList(
        [_Layer() if stage * per <= i < (stage + 1) * per else PPMissingLayer() for i in range(num_layers)]
    )
    model.model.norm = torch.nn.LayerNorm(2) if last else PPMissingLayer()
    model.lm_head = torch.nn.Linear(2, 4) if last else PPMissingLayer()
    if last:
        model.logits_processor = torch.nn.Identity()
    return {
        ("model" if not name else f"model.{name}"): not isinstance(module, PPMissingLayer)
        for name, module in model.named_modules()
    }


@pytest.fixture(scope="module")
def trees():
    return [_stage_tree(0), _stage_tree(1)]


def test_ownership_of_the_full_tree(trees):
    first = build_stage_map(0, trees)
    owner = first.owner
    assert owner["model.model.layers.0.output"] == owner["model.model.layers.1.self_attn.output"] == 0
    assert owner["model.model.layers.2.input"] == owner["model.model.layers.3.mlp.output"] == 1
    assert owner["model.model.embed_tokens.output"] == 0
    assert owner["model.model.norm.output"] == owner["model.lm_head.output"] == 1
    assert owner["model.logits_processor.output"] == 1
    # Containers that span the stages: input on the first, output on the last.
    assert owner["model.input"] == owner["model.model.input"] == owner["model.model.skip"] == 0
    assert owner["model.output"] == owner["model.model.output"] == 1
    assert owner["model.logits"] == owner["model.samples"] == 1
    # Every stage agrees.
    assert build_stage_map(1, trees).owner == owner


def test_locations_outside_the_module_map(trees):
    first = build_stage_map(0, trees)
    assert first.owner_of("model.model.layers.0.mlp.source.linear_0.output") == 0
    assert first.owner_of("model.model.layers.3.mlp.source.linear_0.output") == 1
    assert first.owner_of("model.model.source.layer_0.output") == LOCAL  # inside a spanning forward
    assert first.owner_of("result") == LOCAL


def test_later_locations_missing_modules_and_templates(trees):
    first, second = build_stage_map(0, trees), build_stage_map(1, trees)
    assert "model.model.layers.2.self_attn.output" in first.later
    assert "model.logits" in first.later and "model.output" in first.later
    assert "model.model.layers.1.output" not in first.later
    assert second.later == ()
    assert "model.model.layers.2.self_attn" in first.missing and "model.logits_processor" in first.missing
    assert "model.model.layers.0.mlp" in second.missing and "model.model.embed_tokens" in second.missing
    # A later layer's ghost takes the shape of this stage's last layer.
    assert first.templates["model.model.layers.3.output"] == "model.model.layers.1.output"
    assert first.templates["model.model.layers.2.mlp.input"] == "model.model.layers.1.mlp.input"
    # Wire codes are the same on every stage.
    assert first.names == second.names
    assert first.name(first.code("model.model.layers.2.output")) == "model.model.layers.2.output"
    assert first.code("model.model.layers.0.mlp.source.x.output") == "model.model.layers.0.mlp.source.x.output"


def test_three_stages_split_into_contiguous_owners():
    trees = [_stage_tree(s, num_stages=3, num_layers=6) for s in range(3)]
    middle = build_stage_map(1, trees)
    assert middle.owner["model.model.layers.1.output"] == 0
    assert middle.owner["model.model.layers.2.output"] == 1
    assert middle.owner["model.model.layers.5.output"] == 2
    assert middle.owner["model.model.output"] == 2 and middle.owner["model.model.input"] == 0
    assert all(middle.owner[p] == 2 for p in middle.later)


def test_persistent_objects_answer_for_any_module():
    objects = StagePersistentObjects({"Interleaver": "it"})
    assert "Module:model.model.layers.3.self_attn" in objects
    stub = objects["Module:model.model.layers.3.self_attn"]
    assert isinstance(stub, StageStub) and objects["Module:model.model.layers.3.self_attn"] is stub
    assert "Tokenizer" not in objects
    with pytest.raises(RuntimeError, match="another pipeline stage"):
        stub(torch.ones(1))


def test_a_stand_in_shows_the_operations_of_the_module_it_stands_for():
    """``layers[0].self_attn.source`` on a stage that holds layers 1-: the stand-in's source is the forward of
    the same place in a layer this stage holds, so a block names the same operations on every stage."""
    from nnsight import NNsight
    from vllm.model_executor.models.utils import PPMissingLayer

    from nnsight_ray._internal.pipeline.ownership import forward_templates

    class Attn(torch.nn.Module):
        def forward(self, x):
            y = torch.relu(x)
            return torch.sigmoid(y) * 2

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()

    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([PPMissingLayer(), Layer()])
    templates = forward_templates((envoy.path, envoy._module) for envoy in NNsight(root).modules())
    assert templates == {("model.layers", ""): Layer.forward, ("model.layers", ".self_attn"): Attn.forward}
    objects = StagePersistentObjects({}, templates)
    stub = objects["Module:model.layers.0.self_attn"]
    names = list(NNsight(Attn()).source.names)
    assert list(NNsight(stub).source.names) == names and names[0] == "torch_relu_0"
    assert objects["Module:model.other.self_attn"].forward.__func__ is StageStub.forward  # no place: the plain stand-in


def test_a_placeholder_shows_the_forward_of_the_module_it_stands_for():
    """``layers[0].source`` on a stage that runs layers 1-, ``norm.source`` on a stage before the last: vLLM's
    placeholders take the forward of a layer this stage runs, or the one the stage that runs the module offers
    (``own_forwards``, exchanged at load), before nnsight wraps the model (``lend_forwards``), so nnsight reads
    the same operations there; a placeholder nobody offers keeps its own."""
    from nnsight import NNsight
    from vllm.model_executor.models.utils import PPMissingLayer

    from nnsight_ray._internal.pipeline.ownership import lend_forwards, own_forwards

    class Layer(torch.nn.Module):
        def forward(self, x):
            y = torch.relu(x)
            return torch.sigmoid(y) * 2

    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([PPMissingLayer(), PPMissingLayer(), Layer()])
    root.norm = PPMissingLayer()
    root.head = PPMissingLayer()
    last = torch.nn.Module()  # the last stage: it runs the norm
    last.layers = torch.nn.ModuleList([PPMissingLayer(), PPMissingLayer(), PPMissingLayer()])
    last.norm = torch.nn.LayerNorm(4)
    last.local = Layer()  # defined in a function: no reference to send, not offered
    offered = own_forwards(last)
    assert list(offered) == ["norm"] and pickle.loads(offered["norm"]) is torch.nn.LayerNorm.forward
    # a forward this process cannot import is not lent (here: the head's), and nothing fails
    unknown = {"head": pickle.dumps(torch.nn.LayerNorm.forward).replace(b"torch.nn", b"nowhere_")}
    assert lend_forwards(root, [own_forwards(root), offered, unknown]) == ["layers.0", "layers.1", "norm"]
    wrapped = NNsight(root)
    names = list(NNsight(Layer()).source.names)
    assert list(wrapped.layers[0].source.names) == names and names[0] == "torch_relu_0"
    assert list(wrapped.norm.source.names) == list(NNsight(torch.nn.LayerNorm(4)).source.names)
    assert "torch_relu_0" not in list(wrapped.head.source.names)  # offered by nobody: its own forward
    # a stage that runs no item of a list and is offered nothing lends nothing
    bare = torch.nn.Module()
    bare.layers = torch.nn.ModuleList([PPMissingLayer()])
    assert lend_forwards(bare) == []


# --- messages -----------------------------------------------------------------


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_message_roundtrip_and_tp_padding(tp_size):
    message = StageMessage(
        order=[3, 1, "model.model.layers.0.mlp.source.x.output"],
        values={(("req-1", ""), 3, 0): [(torch.arange(6.0).view(2, 3), None), WRITTEN]},
        stopped={("req-2", "reg"): "on stage 0: GhostStop: ..."},
    )
    packed = encode_message(message, tp_size)
    assert set(packed) == {pp.KEY, pp.KEY_DATA}
    assert all(t.dtype == torch.uint8 for t in packed.values())
    if tp_size > 1:
        # vLLM would split and all-gather a divisible tensor across the TP group.
        assert all(t.numel() % tp_size != 0 for t in packed.values())
    back = decode_message(packed[pp.KEY], packed.get(pp.KEY_DATA))
    assert back.order == message.order and back.stopped == message.stopped
    (value, none), written = back.values[(("req-1", ""), 3, 0)]
    assert torch.equal(value, torch.arange(6.0).view(2, 3)) and none is None and written is WRITTEN


def test_message_tensors_of_any_dtype_and_shape():
    values = [torch.arange(5, dtype=torch.int64), torch.randn(2, 3).to(torch.bfloat16), torch.tensor(True), torch.empty(0, 4), torch.randn(3, 4)[:, 1]]
    packed = encode_message(StageMessage(values={(("r", ""), 0, 0): values}))
    back = decode_message(packed[pp.KEY], packed[pp.KEY_DATA]).values[(("r", ""), 0, 0)]
    for got, want in zip(back, values):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_unpicklable_recording_becomes_an_error_not_a_crash():
    message = StageMessage(values={(("r", ""), 0, 0): [lambda: 1, torch.ones(1)]})
    packed = encode_message(message)
    back = decode_message(packed[pp.KEY], packed.get(pp.KEY_DATA))
    bad, good = back.values[(("r", ""), 0, 0)]
    assert isinstance(bad, Unsendable) and torch.equal(good, torch.ones(1))


# --- two stages, real mediators ----------------------------------------------


L = lambda i: f"model.model.layers.{i}.output"  # noqa: E731

BLOCK = """
h = Mediator.value(L(1))[0].clone()
x = Mediator.value(L(3))
x[0][:] += h
b = x[0].clone()
a = Mediator.value(L(0))
"""

BLOCK_ORDERED = """
a = Mediator.value(L(0))[0].clone()
h = Mediator.value(L(1))[0].clone()
x = Mediator.value(L(3))
x[0][:] += h
b = x[0].clone()
hidden, residual = Mediator.value(L(3))
"""


def _stage(index, trees):
    from nnsight.modeling.vllm.interleaver import VLLMInterleaver

    interleaver = VLLMInterleaver()
    interleaver.defer_exceptions = True  # as nnsight's runner sets it
    state = pp.StageState(map=build_stage_map(index, trees))
    pp.StageInterleaver.install(interleaver, state)
    return interleaver, state


def _mediator(source: str, state):
    from nnsight.intervention.interleaver import Mediator

    mediator = Mediator(compile(source, "<block>", "exec"), {"Mediator": Mediator, "L": L, "torch": torch}, {})
    state.adopt(mediator, ("req-1", ""))
    return mediator


def _run_stage(interleaver, state, mediator, message, forward):
    """One step of one stage: enter, receive, hand each own location to `handle`, drain."""
    interleaver.mediators = [mediator]
    step = state.begin(message)
    with interleaver:
        for provider, value in forward:
            interleaver.handle(provider, value)
        if not step.caught_up:
            interleaver.catch_up()
        if not state.map.is_last:
            interleaver.drain()
            interleaver.settle()
    return state.outgoing() if step.busy and not state.map.is_last else None


def _outputs(seed):
    torch.manual_seed(seed)
    return {i: (torch.randn(3, 2), torch.randn(3, 2)) for i in range(4)}


def test_two_stages_equal_one_device(trees):
    outputs = _outputs(0)
    from nnsight.intervention.interleaver import Mediator

    one = Mediator(compile(BLOCK_ORDERED, "<block>", "exec"), {"Mediator": Mediator, "L": L, "torch": torch}, {})
    # One device: every location, in order.
    from nnsight.modeling.vllm.interleaver import VLLMInterleaver

    single = VLLMInterleaver()
    single.mediators = [one]
    with single:
        for i in range(4):
            single.handle(L(i), tuple(t.clone() for t in outputs[i]))
    expected = {k: one.lcls[k] for k in ("a", "h", "b", "hidden", "residual")}

    first, first_state = _stage(0, trees)
    second, second_state = _stage(1, trees)
    m0, m1 = _mediator(BLOCK_ORDERED, first_state), _mediator(BLOCK_ORDERED, second_state)
    sent = _run_stage(first, first_state, m0, None, [(L(0), outputs[0]), (L(1), outputs[1])])
    assert isinstance(m0.lcls["x"], Ghost) or isinstance(m0.lcls["x"], tuple)
    assert isinstance(m0.lcls["b"], Ghost)
    assert torch.equal(m0.lcls["a"], expected["a"])
    assert sent is not None and [first_state.map.name(c) for c in sent.order] == [L(0), L(1)]
    # Over the wire, as vLLM would carry it.
    packed = encode_message(sent)
    received = decode_message(packed[pp.KEY], packed.get(pp.KEY_DATA))
    _run_stage(second, second_state, m1, received, [(L(2), outputs[2]), (L(3), tuple(t.clone() for t in outputs[3]))])
    for name, value in expected.items():
        assert torch.equal(m1.lcls[name], value), name
    assert m1.exception is None and not m1.alive
    # Counts advanced once per location on both stages.
    assert first.counts[L(3)] == second.counts[L(0)] == 1


def test_ghosted_copy_error_is_not_reported_but_travels(trees):
    first, state = _stage(0, trees)
    mediator = _mediator("y = Mediator.value(L(3))[0]\nif y.sum() > 0:\n    pass\n", state)
    sent = _run_stage(first, state, mediator, None, [(L(0), _outputs(1)[0]), (L(1), _outputs(1)[1])])
    # Stopped quietly: nothing to report from this stage ...
    assert mediator.exception is None and not mediator.alive
    # ... but the next stage learns why this copy ended.
    assert "GhostStop" in sent.stopped[("req-1", "")]


def test_missing_recording_names_location_step_and_stage(trees):
    second, state = _stage(1, trees)
    mediator = _mediator("a = Mediator.value(L(0))\n", state)
    message = StageMessage(order=[state.map.code(L(0)), state.map.code(L(1))], stopped={("req-1", ""): "on stage 0: GhostStop: bool() of ..."})
    _run_stage(second, state, mediator, message, [(L(2), _outputs(2)[2])])
    error = mediator.exception
    assert isinstance(error, PipelineDependencyError)
    text = str(error)
    assert "pipeline stage 1 needs the value of model.model.layers.0.output" in text
    assert "step 0" in text and "stage 0" in text and "GhostStop" in text


def test_write_on_an_earlier_stage_must_have_happened_there(trees):
    second, state = _stage(1, trees)
    mediator = _mediator("Mediator.swap(L(1), (torch.zeros(3, 2), torch.zeros(3, 2)))\n", state)
    code = state.map.code(L(1))
    ok = StageMessage(order=[state.map.code(L(0)), code], values={(("req-1", ""), code, 0): [WRITTEN]})
    _run_stage(second, state, mediator, ok, [(L(2), _outputs(3)[2])])
    assert mediator.exception is None and not mediator.alive

    second, state = _stage(1, trees)
    mediator = _mediator("Mediator.swap(L(1), (torch.zeros(3, 2), torch.zeros(3, 2)))\n", state)
    missing = StageMessage(order=[state.map.code(L(0)), code])
    _run_stage(second, state, mediator, missing, [(L(2), _outputs(3)[2])])
    assert isinstance(mediator.exception, PipelineDependencyError)
    assert "the write to model.model.layers.1.output" in str(mediator.exception)


def test_swapping_in_a_ghost_is_refused(trees):
    first, state = _stage(0, trees)
    source = "\n".join(
        [
            "for step in range(2):",
            "    Mediator.current('step').iteration = step  # what tracer.iter does",
            "    if step:",
            "        Mediator.swap(L(0), (prev, prev))",
            "    else:",
            "        Mediator.value(L(0))",
            "    prev = Mediator.value(L(3))[0] * 2",
        ]
    )
    mediator = _mediator(source, state)
    outputs = _outputs(4)
    _run_stage(first, state, mediator, None, [(L(0), outputs[0]), (L(1), outputs[1])])
    assert mediator.alive  # parked on step 1's layer 0
    _run_stage(first, state, mediator, None, [(L(0), outputs[0]), (L(1), outputs[1])])
    assert isinstance(mediator.exception, PipelineDependencyError)
    assert "written to model.model.layers.0.output" in str(mediator.exception)


# --- collection ----------------------------------------------------------------


def test_names_holding_a_ghost_are_left_to_the_stage_that_has_the_value():
    real = torch.ones(2)
    saves = {"a": real, "b": ghost(), "c": [real, ghost()], "d": {"x": real}}
    assert ghost_free(saves) == {"a": real, "d": {"x": real}}


def test_errors_from_copies_that_saw_ghosts_are_not_reported():
    plain = {"type_name": "RuntimeError", "message": "shape mismatch"}
    dependency = {"type_name": "PipelineDependencyError", "message": "edit of ..."}

    def request(error, own_error=None):
        return SimpleNamespace(error=own_error, mediator=SimpleNamespace(nnsight_error=error))

    assert reported_error(request(plain), ghosted=False) is plain
    assert reported_error(request(plain), ghosted=True) is None
    assert reported_error(request(dependency), ghosted=True) is dependency
    refused = {"type_name": "ValueError", "message": "edits=['x'] ..."}
    assert reported_error(request(plain, own_error=refused), ghosted=True) is refused


def test_a_blocks_bookkeeping_lives_with_its_stage_not_on_the_mediator(trees):
    first, state = _stage(0, trees)
    mediator = _mediator("y = Mediator.value(L(3))[0]\n", state)
    before = set(vars(mediator))
    _run_stage(first, state, mediator, None, [(L(0), _outputs(5)[0]), (L(1), _outputs(5)[1])])
    block = state.blocks[mediator]
    assert isinstance(block, Block) and block.key == ("req-1", "") and block.ghosted
    assert state.ghosted(mediator) and not state.ghosted(None)
    assert not {name for name in set(vars(mediator)) - before if "pp" in name}
    state.adopt(mediator, ("other", ""))  # a block keeps the key it was adopted under
    assert state.blocks[mediator].key == ("req-1", "")
