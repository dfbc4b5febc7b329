"""Hundreds of received blocks with nested ``with`` statements, on one long-lived rank (``_internal/blocks/block_names.py``).

nnsight 0.8.1 names a received block ``<edit-{id(mediator)}>`` and memoizes a
nested ``with`` by that name forever; sequential traces on one rank reuse
addresses, so without a unique name per block a block whose nested ``with``
sits on another line than an earlier block's is parsed from the earlier
block's source ("nnsight found no `with` statement at <edit-...>").
"""

from __future__ import annotations

import warnings

import nnsight
import pytest

from conftest import assert_close, request_counts

pytestmark = pytest.mark.integration

PROMPT = "Hello world"


def nested_on_line_two(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:
        out = nnsight.save([])
        with tracer.iter[0:2]:
            out.append(model.logits[-1].clone())
    return out


def nested_on_line_three(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:
        out = nnsight.save([])
        scale = 2.0
        with tracer.iter[0:2]:
            out.append(model.logits[-1].clone() * scale)
    return out


def test_three_hundred_blocks_each_parsed_from_their_own_source(ray_tp1, local_llama):
    warnings.simplefilter("ignore")  # the `with tracer.iter[...]` form is deprecated, and is the point here
    want = nested_on_line_two(local_llama)
    assert len(want) == 2
    for i in range(150):
        a = nested_on_line_two(ray_tp1)
        b = nested_on_line_three(ray_tp1)
        assert len(a) == len(b) == 2, i
        for step in range(2):
            assert_close(a[step], want[step])
            assert_close(b[step], want[step] * 2.0)
    assert request_counts(ray_tp1) == [0]


def test_names_are_forgotten_when_collected(ray_tp1):
    nested_on_line_three(ray_tp1)
    assert ray_tp1.vllm_entrypoint.collective_rpc("nnsight_ray_block_names") == [
        {"linecache": 0, "sources": 0, "blocks": 0, "tracked": 0}]
