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

    from nnsight_ray._internal.shared_blocks import shared_reductions

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

    from nnsight_ray._internal.shared_blocks import shared_reductions

    mediators = workers(3)
    plain = [loads(dumps(m)) for m in workers(3)]
    with shared_reductions(mediators):
        shared = [loads(dumps(m)) for m in mediators]
    for ours, theirs in zip(shared, plain):
        assert type(ours) is Mediator
        assert ours.code.co_code == theirs.code.co_code
        assert dict(ours.lcls.items()) == dict(theirs.lcls.items()) and ours.glbls == theirs.glbls


def test_classes_are_restored_even_when_the_attach_fails():
    from nnsight.intervention.interleaver import Mediator

    from nnsight_ray._internal.shared_blocks import shared_reductions

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

    from nnsight_ray._internal.shared_blocks import shared_reductions

    node = ast.parse("with tracer.invoke(text):\n" + "\n".join("    " + line for line in body.splitlines())).body[0]
    code = compile(ast.Module(body=node.body, type_ignores=[]), "<block>", "exec")
    old = [object() for _ in range(3)]
    mediators = [Mediator(code, {"nnsight": None, "tracer": None, "print": print},
                          {"h": old, "x": 1, "text": "t"}, node=node)]
    with shared_reductions(mediators):
        state = mediators[0].__getstate__()
    assert set(state["reduced"][2]) - {"x"} == shipped
    assert "x" in state["reduced"][2] or "x" not in body
