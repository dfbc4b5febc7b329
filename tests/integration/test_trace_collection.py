"""A trace's collection on RayVLLM (issue 53): its invokes end over several steps and are collected together,
and only the blocks parked on ``tracer.result`` get their ``RequestOutput`` sent to the ranks.

Values are checked against nnsight's in-process engine (``local_llama``), on one rank and on two (TP=2).
"""

from __future__ import annotations

import pytest

from conftest import assert_close, request_counts

pytestmark = pytest.mark.integration


def _mixed(model):
    """Four invokes ending at different steps; two read the run's result, three a layer."""
    layer = model.model.layers[1]
    with model.trace(temperature=0.0, ignore_eos=True) as tracer:
        with tracer.invoke("Hello", max_tokens=1):
            h0 = layer.output[0][-1].clone().save()
        with tracer.invoke("A longer prompt here", max_tokens=3):
            h1 = layer.output[0][-1].clone().save()
            r1 = tracer.result.save()
        with tracer.invoke("The third one", max_tokens=5):
            h2 = layer.output[0][-1].clone().save()
        with tracer.invoke("Fourth", max_tokens=4):
            r3 = tracer.result.save()
    tokens = [(list(r.prompt_token_ids), list(r.outputs[0].token_ids)) for r in (r1, r3)]
    return [h0, h1, h2], tokens


@pytest.mark.parametrize("engine", ["ray_tp1", "ray_tp2"])
def test_invokes_ending_over_several_steps_come_home_with_results_where_read(request, engine, local_llama):
    model = request.getfixturevalue(engine)
    want_rows, want_tokens = _mixed(local_llama)
    before = model.health()["collect"]
    got_rows, got_tokens = _mixed(model)
    assert got_tokens == want_tokens and [len(t[1]) for t in got_tokens] == [3, 4]
    for got, want in zip(got_rows, want_rows):
        assert_close(got, want)
    after = model.health()["collect"]  # the four requests were collected by one collection
    assert (after["calls"] - before["calls"], after["requests"] - before["requests"]) == (1, 4)
    assert request_counts(model) == [0] * len(request_counts(model))
