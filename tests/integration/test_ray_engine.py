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

from conftest import ENGINE_KWARGS, assert_close, request_counts

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


def test_topology_names_ranks_and_spreads_nodes(ray_tp2):
    topology = ray_tp2.topology()
    assert [(t["pp_rank"], t["tp_rank"]) for t in topology] == [(0, 0), (0, 1)]
    assert [t["actor_name"] for t in topology] == ["tp2.pp0.tp0", "tp2.pp0.tp1"]
    assert len({t["node_id"] for t in topology}) == 2, "STRICT_SPREAD put two ranks on one node"
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {t["node_id"] for t in topology} <= alive


def test_local_vllm_matches_transformers_sanity(local_llama, reference):
    # The reference itself produces greedy tokens from its own logits.
    want = reference[PROMPTS[0]]
    assert int(want["logits"].argmax(-1)[-1]) == want["tokens"][0]


@pytest.mark.parametrize("engine", ["ray_tp1", "ray_tp2"])
def test_tensor_parallel_matches_single_device(request, engine, reference):
    check_against(reference, request.getfixturevalue(engine))


@pytest.mark.parametrize("engine", ["ray_pp2", "ray_tp2pp2"])
def test_pipeline_parallel_matches_single_device(request, engine, reference):
    model = request.getfixturevalue(engine)
    nodes = {t["node_id"] for t in model.topology()}
    assert len(nodes) >= 2
    check_against(reference, model)


def test_registered_block_reads_first_and_last_stage(ray_pp2, local_llama):
    prompts = ["Hello", "World!"]
    with ray_pp2.edit() as (tracer, edit):
        first = ray_pp2.model.layers[0].output[0].clone().save()
        last = ray_pp2.model.layers[3].output[0].clone().save()
    try:
        outputs = ray_pp2.generate(prompts, max_tokens=2, temperature=0.0)
    finally:
        edit.clear()
    for prompt, output in zip(prompts, outputs):
        with local_llama.trace(prompt, temperature=0.0, max_tokens=1):
            want_first = local_llama.model.layers[0].output[0].clone().save()
            want_last = local_llama.model.layers[3].output[0].clone().save()
        assert_close(output.saves["first"], want_first)
        assert_close(output.saves["last"], want_last)
    after = ray_pp2.generate(prompts, max_tokens=1, temperature=0.0)
    assert all(not o.saves for o in after)
    assert request_counts(ray_pp2) == [0, 0]


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
