"""Rank actors and RayVLLM on a real multi-raylet Ray cluster with the real CPU engine.

Every value is compared with nnsight's in-process engine (``local_llama``) on
the same checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import nnsight
import pytest
import ray
import torch

from conftest import ENGINE_KWARGS, assert_close, ray_engine, request_counts

pytestmark = pytest.mark.integration

PROMPTS = ["Hello world", "The quick brown fox", "abc"]
N_LAYERS = 4


def residual_trace(model, prompt: str, max_tokens: int = 3) -> dict:
    """Prefill residual stream of every layer, the first logits, the greedy tokens."""
    with model.trace(prompt, temperature=0.0, max_tokens=max_tokens) as tracer:
        layers = nnsight.save([
            (model.model.layers[i].output[0] + model.model.layers[i].output[1]).clone()
            for i in range(N_LAYERS)
        ])
        logits = model.logits.clone().save()
        result = tracer.result.save()
    return {"layers": layers, "logits": logits, "tokens": list(result.outputs[0].token_ids)}


LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2, placement_strategy="STRICT_SPREAD"),
    "pp2": dict(pipeline_parallel_size=2, placement_strategy="STRICT_SPREAD"),
    "tp2pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, placement_strategy="SPREAD"),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, model_dir):
    """One multi-rank layout at a time (pytest tears each down before the next).

    TP=2 is the session's engine (the batch tests use it too)."""
    if request.param == "tp2":
        yield request.param, request.getfixturevalue("ray_tp2")
        return
    model = ray_engine(request, model_dir, request.param, **LAYOUTS[request.param])
    yield request.param, model
    model.shutdown()


@pytest.fixture(scope="module")
def reference(local_llama):
    return {p: residual_trace(local_llama, p) for p in PROMPTS}


def check_against(reference, model) -> None:
    for prompt in PROMPTS:
        got, want = residual_trace(model, prompt), reference[prompt]
        assert got["tokens"] == want["tokens"]
        assert_close(got["logits"], want["logits"])
        for layer in range(N_LAYERS):
            assert_close(got["layers"][layer], want["layers"][layer])
    assert request_counts(model) == [0] * len(request_counts(model))


# -- rank actors: placement, identities, layouts ------------------------------


def test_topology_names_ranks_and_spreads_nodes(layout):
    name, model = layout
    tp, pp = LAYOUTS[name].get("tensor_parallel_size", 1), LAYOUTS[name].get("pipeline_parallel_size", 1)
    topology = model.topology()
    assert [(t["pp_rank"], t["tp_rank"]) for t in topology] == [(p, t) for p in range(pp) for t in range(tp)]
    assert [t["actor_name"] for t in topology] == [f"{name}.pp{p}.tp{t}" for p in range(pp) for t in range(tp)]
    nodes = [t["node_id"] for t in topology]
    if LAYOUTS[name]["placement_strategy"] == "STRICT_SPREAD":
        assert len(set(nodes)) == len(nodes), "STRICT_SPREAD put two ranks on one node"
    else:
        assert len(set(nodes)) >= 2
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(nodes) <= alive


def test_local_vllm_reference_is_self_consistent(reference):
    want = reference[PROMPTS[0]]
    assert int(want["logits"].argmax(-1)[-1]) == want["tokens"][0]


def test_single_rank_ray_engine_matches_local(ray_tp1, reference):
    check_against(reference, ray_tp1)


def test_layout_matches_single_device(layout, reference):
    check_against(reference, layout[1])


def test_registered_block_reads_first_and_last_stage(layout, local_llama):
    _, model = layout
    prompts = ["Hello", "World!"]
    with model.edit() as (tracer, edit):
        first = model.model.layers[0].output[0].clone().save()
        last = model.model.layers[3].output[0].clone().save()
    try:
        outputs = model.generate(prompts, max_tokens=2, temperature=0.0)
    finally:
        edit.clear()
    for prompt, output in zip(prompts, outputs):
        with local_llama.trace(prompt, temperature=0.0, max_tokens=1):
            want_first = local_llama.model.layers[0].output[0].clone().save()
            want_last = local_llama.model.layers[3].output[0].clone().save()
        assert_close(output.saves["first"], want_first)
        assert_close(output.saves["last"], want_last)
    after = model.generate(prompts, max_tokens=1, temperature=0.0)
    assert all(not o.saves for o in after)
    counts = request_counts(model)
    assert counts == [0] * len(counts)


def test_unsatisfiable_placement_fails_fast_with_what_was_asked(ray_cluster, model_dir):
    from nnsight_ray import RayVLLM
    from nnsight_ray.errors import PlacementError

    with pytest.raises(PlacementError) as info:
        RayVLLM(model_dir, name="too-big", tensor_parallel_size=2, cpus_per_rank=64,
                placement_timeout_s=3, **ENGINE_KWARGS)
    message = str(info.value)
    assert "'CPU': 64" in message and "STRICT" not in message or "PACK" in message
    assert "Cluster total" in message
    assert "too-big.engine" not in [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
