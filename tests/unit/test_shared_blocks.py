"""A trace's invokes reduce their shared block once (``_internal.shared_blocks``), on nnsight's real pickler."""

from __future__ import annotations

import ast

import pytest

BLOCK = """
with tracer.invoke(text):
    h = model.layers[layer].output[0][-1]
    if scale:
        h = h * scale
    h = h.save()
"""


def workers(n: int, block: str = BLOCK):
    """``n`` invokes of one block (one AST node), as a loop of ``tracer.invoke`` builds them."""
    from nnsight.intervention.interleaver import Mediator

    node = ast.parse(block).body[0]
    code = compile(ast.Module(body=node.body, type_ignores=[]), "<block>", "exec")
    glbls = {"model": "the-model", "layer": 3, "unused_global": object()}
    return [Mediator(code, glbls, {"text": f"prompt {i}", "scale": i, "tracer": None}, node=node) for i in range(n)]


def test_state_is_nnsights_own_for_every_invoke_and_the_block_is_reduced_once(monkeypatch):
    from nnsight.intervention import serialization
    from nnsight.intervention.interleaver import Mediator

    from nnsight_ray._internal.blocks.shared_blocks import shared_reductions

    theirs = [Mediator.__getstate__(m) for m in workers(5)]
    calls = []
    real = serialization._referenced_names
    monkeypatch.setattr(serialization, "_referenced_names", lambda source: calls.append(1) or real(source))
    mediators = workers(5)
    with shared_reductions(mediators):
        ours = [m.__getstate__() for m in mediators]
    assert ours == theirs
    assert len(calls) == 1  # one block, five invokes: nnsight reduced it once
    assert all(set(state["reduced"][2]) == {"scale"} for state in ours)  # the body reads scale, not text
    assert all(set(state["reduced"][1]) == {"model", "layer"} for state in ours)
    assert ours[3]["reduced"][2]["scale"] == 3 and "unused_global" not in ours[3]["reduced"][1]


def test_pickles_as_a_plain_mediator_that_nnsight_rebuilds():
    from nnsight.intervention.interleaver import Mediator
    from nnsight.intervention.serialization import dumps, loads

    from nnsight_ray._internal.blocks.shared_blocks import shared_reductions

    mediators = workers(3)
    plain = [loads(dumps(m)) for m in workers(3)]
    with shared_reductions(mediators):
        shared = [loads(dumps(m)) for m in mediators]
    for ours, theirs in zip(shared, plain):
        assert type(ours) is Mediator
        assert ours.code.co_code == theirs.code.co_code
        assert dict(ours.lcls.items()) == dict(theirs.lcls.items()) and ours.glbls == theirs.glbls


def test_invokes_holding_the_same_objects_pickle_their_state_once(monkeypatch):
    """A loop of invokes that reads the same objects: nnsight's pickler runs on the state once, and every
    request still carries bytes that rebuild a worker of its own."""
    from nnsight.intervention import serialization
    from nnsight.intervention.interleaver import Mediator
    from nnsight.intervention.serialization import dumps, loads

    from nnsight_ray._internal.blocks.shared_blocks import shared_reductions

    scale = 2.5
    mediators = workers(4) + workers(2)
    for m in mediators[:4]:
        m.lcls["scale"] = scale  # the same object: one state
    calls = []
    real = serialization.dumps
    monkeypatch.setattr(serialization, "dumps", lambda obj, *a, **k: calls.append(type(obj).__name__) or real(obj, *a, **k))
    with shared_reductions(mediators):
        blobs = [dumps(m) for m in mediators]
    assert calls.count("dict") == 3  # the four sharing scale once; the two others (scale 0 and 1) once each
    assert len(set(blobs[:4])) == 1 and len(set(blobs)) == 3
    rebuilt = [loads(b) for b in blobs[:4]]
    assert all(type(m) is Mediator and m.lcls["scale"] == scale for m in rebuilt)
    assert len({id(m) for m in rebuilt}) == 4 and len({id(m.lcls) for m in rebuilt}) == 4
    assert all("_nnsight_ray_blobs" not in m.__dict__ for m in mediators)


def test_a_shared_state_resolves_envoy_references_with_the_ranks_persistent_objects():
    """An envoy travels as a reference inside the shared bytes: the rank's ``Requests.add`` (``NamedRequests``)
    hands the unpickling its persistent objects."""
    from nnsight.intervention.serialization import dumps, loads

    from nnsight_ray._internal.blocks.block_names import _unpickling_with
    from nnsight_ray._internal.blocks.shared_blocks import shared_reductions

    class Envoy:
        pass

    caller_side, rank_side = Envoy(), object()
    caller_side._persistent_id = "Envoy:model.layers.3"
    mediators, scale = workers(2), 1.5
    for m in mediators:
        m.glbls["model"], m.lcls["scale"] = caller_side, scale
    with shared_reductions(mediators):
        blobs = [dumps(m) for m in mediators]
    assert blobs[0] == blobs[1]
    with _unpickling_with({"Envoy:model.layers.3": rank_side}):
        rebuilt = loads(blobs[0])
    assert rebuilt.glbls["model"] is rank_side


def test_classes_are_restored_even_when_the_attach_fails():
    from nnsight.intervention.interleaver import Mediator

    from nnsight_ray._internal.blocks.shared_blocks import shared_reductions

    mediators = workers(2) + [Mediator(None, {}, {})]  # a worker with no block is left alone
    with pytest.raises(RuntimeError):
        with shared_reductions(mediators):
            assert type(mediators[0]) is not Mediator and type(mediators[2]) is Mediator
            raise RuntimeError("attach failed")
    assert all(type(m) is Mediator and "_nnsight_ray_reductions" not in m.__dict__ for m in mediators)


@pytest.mark.parametrize("body, shipped", [
    ("h = nnsight.save([])\nfor _ in tracer.all():\n    h.append(x)", set()),  # bound, then read: not shipped
    ("h = h + [1]\nh.append(x)", {"h"}),  # the right side reads the old value
    ("if x:\n    h = []\nh.append(x)", {"h"}),  # bound only sometimes
    ("print(h)\nh = []", {"h"}),  # read first
    ("h += [x]", {"h"}),  # an augmented assignment reads
    ("a, (b, *h) = x\nh.append(a)", set()),  # names in nested tuple targets are bound
    ("h[0] = x\nh = []", {"h"}),  # a subscript target reads h
    ("f = lambda: h\nh = []\nf()", {"h"}),  # mentioned before the binding
])
def test_a_name_bound_before_it_is_read_does_not_ship_its_old_value(body, shipped):
    """A notebook cell run twice: the old ``h`` (last run's saves) is never what the block sees."""
    from nnsight.intervention.interleaver import Mediator

    from nnsight_ray._internal.blocks.shared_blocks import shared_reductions

    node = ast.parse("with tracer.invoke(text):\n" + "\n".join("    " + line for line in body.splitlines())).body[0]
    code = compile(ast.Module(body=node.body, type_ignores=[]), "<block>", "exec")
    old = [object() for _ in range(3)]
    mediators = [Mediator(code, {"nnsight": None, "tracer": None, "print": print},
                          {"h": old, "x": 1, "text": "t"}, node=node)]
    with shared_reductions(mediators):
        state = mediators[0].__getstate__()
    assert set(state["reduced"][2]) - {"x"} == shipped
    assert "x" in state["reduced"][2] or "x" not in body


def test_equal_payloads_become_one_object_so_the_requests_pickle_it_once():
    import pickle
    from types import SimpleNamespace

    from nnsight_ray._internal.blocks.shared_blocks import one_object_per_payload

    blob = bytes(1500)
    params = [SimpleNamespace(extra_args={"nnsight_mediator": bytes(bytearray(blob)), "other": i}) for i in range(8)]
    params += [SimpleNamespace(extra_args=None), SimpleNamespace(extra_args={"nnsight_mediator": b"another"})]
    before = len(pickle.dumps([p.extra_args for p in params]))
    assert len({id(p.extra_args["nnsight_mediator"]) for p in params[:8]}) == 8  # as nnsight's attach leaves them
    one_object_per_payload(params)
    shared = {id(p.extra_args["nnsight_mediator"]) for p in params[:8]}
    assert len(shared) == 1 and params[0].extra_args["nnsight_mediator"] == blob
    assert params[9].extra_args["nnsight_mediator"] == b"another" and params[8].extra_args is None
    assert [p.extra_args["other"] for p in params[:8]] == list(range(8))
    assert len(pickle.dumps([p.extra_args for p in params])) < before - 6 * len(blob)


def test_a_rank_reads_an_immutable_shared_state_once_and_gives_each_invoke_its_own_scope(monkeypatch):
    """Equal blobs in one ``Requests.add``: a state of numbers, strings and envoy references is loaded once
    (each worker gets its own scope dicts over those values); one holding a list is loaded per invoke."""
    from nnsight.intervention import serialization
    from nnsight.intervention.serialization import dumps, loads

    from nnsight_ray._internal.blocks.block_names import _unpickling_with
    from nnsight_ray._internal.blocks.shared_blocks import shared_reductions

    class Envoy:
        pass

    caller_side, rank_side = Envoy(), Envoy()
    caller_side._persistent_id = "Envoy:model.layers.3"
    from nnsight.tracing.tracer import Tracer

    immutable, mutable = workers(3, BLOCK.replace("h = h.save()", "h = h.save()\n    tracer.stop()")), workers(3)
    shared_list, tracer = [], Tracer()
    for m in immutable:
        m.glbls["model"], m.lcls["scale"], m.lcls["tracer"] = caller_side, 1.5, tracer
    for m in mutable:
        m.glbls["model"], m.lcls["scale"] = caller_side, shared_list
    with shared_reductions(immutable + mutable):
        blobs = [dumps(m) for m in immutable + mutable]
    loads_calls = []
    real_loads = serialization.loads
    monkeypatch.setattr(serialization, "loads",  # the rank's reads of the shared state (the blobs' own are not counted)
                        lambda data, *a, **k: loads_calls.append(len(data)) or real_loads(data, *a, **k))
    with _unpickling_with({"Envoy:model.layers.3": rank_side}):
        rebuilt = [loads(b) for b in blobs]
    assert len(loads_calls) == 1 + 3  # the immutable state once, the one holding a list once per invoke
    for m in rebuilt[:3]:
        assert m.glbls["model"] is rank_side and m.lcls["scale"] == 1.5 and type(m.lcls["tracer"]) is Tracer
    assert len({id(m.lcls["tracer"]) for m in rebuilt[:3]}) == 3  # each invoke its own tracer, as unpickled
    assert len({id(m.lcls) for m in rebuilt}) == 6 and len({id(m.glbls) for m in rebuilt[:3]}) == 3
    lists = [m.lcls["scale"] for m in rebuilt[3:]]
    assert all(v == [] for v in lists) and len({id(v) for v in lists}) == 3  # never one list for two invokes
    rebuilt[0].presaved.add("h")
    assert "h" not in rebuilt[1].presaved
    with _unpickling_with({"Envoy:model.layers.3": rank_side}):  # a later add reads its blobs afresh
        loads_calls.clear()
        loads(blobs[0])
    assert len(loads_calls) == 1


def test_an_attach_pickles_each_distinct_state_once_into_bytes_equal_to_nnsights(monkeypatch):
    """``VLLM._attach_mediators`` calls its module's ``dumps`` per invoke: within ``shared_reductions`` the
    request bytes of equal states are made once (one object), equal to nnsight's own pickling of each."""
    from nnsight.intervention import serialization
    from nnsight.modeling.vllm import vllm as nnsight_vllm

    from nnsight_ray._internal.blocks import shared_blocks

    def attach(mediators, cache: bool) -> list[bytes]:
        monkeypatch.setattr(shared_blocks, "PAYLOAD_CACHE", cache)
        with shared_blocks.shared_reductions(mediators):
            assert (nnsight_vllm.dumps is shared_blocks._attach_dumps) is cache
            payloads = [nnsight_vllm.dumps(m) for m in mediators]
        assert nnsight_vllm.dumps is serialization.dumps and shared_blocks._attaches == 0
        return payloads

    def made(scale):
        mediators = workers(4) + workers(2)
        for m in mediators[:4]:
            m.lcls["scale"] = scale  # the same object: one state
        return mediators

    scale = 2.5
    theirs = attach(made(scale), cache=False)
    pickled = []
    reduce = shared_blocks.SharedReductionMediator.__reduce_ex__
    monkeypatch.setattr(shared_blocks.SharedReductionMediator, "__reduce_ex__",
                        lambda self, protocol: pickled.append(1) or reduce(self, protocol))
    ours = attach(made(scale), cache=True)
    assert ours == theirs and len({id(p) for p in ours[:4]}) == 1 and len(set(ours)) == 3
    assert len(pickled) == 3  # nnsight's pickler ran once per distinct state, not once per invoke
    with shared_blocks.shared_reductions(workers(1)):  # anything else: nnsight's own
        assert nnsight_vllm.dumps({"a": [1]}) == serialization.dumps({"a": [1]})
