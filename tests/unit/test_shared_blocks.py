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


def workers(n: int):
    """``n`` invokes of one block (one AST node), as a loop of ``tracer.invoke`` builds them."""
    from nnsight.intervention.interleaver import Mediator

    node = ast.parse(BLOCK).body[0]
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
