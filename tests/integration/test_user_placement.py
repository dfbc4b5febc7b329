"""A caller's own placement group, and vLLM's ``VLLM_RAY_BUNDLE_INDICES`` choosing its bundles.

``placement_group=`` hands the ranks a group the caller reserved (one shared
with other work, say); ``VLLM_RAY_BUNDLE_INDICES`` (vLLM's variable, kept by
``NNsightRayExecutor``) says which of its bundles rank 0, 1, ... take. The
group stays the caller's: shutting the engine down leaves it reserved.
"""

from __future__ import annotations

import sys

import cloudpickle
import nnsight
import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from conftest import ENGINE_KWARGS, assert_close, request_counts

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def layers(model, prompt: str = "Hello world") -> list:
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        saved = nnsight.save([(model.model.layers[i].output[0] + model.model.layers[i].output[1]).clone()
                              for i in range(4)])
    return saved


def test_a_callers_group_with_vllm_bundle_indices_places_each_rank_on_its_bundle(
        ray_cluster, model_dir, local_llama, monkeypatch):
    from nnsight_ray import RayVLLM

    group = placement_group([{"CPU": 1}] * 3, strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=60)
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    # Read by vLLM's executor in the engine core; nnsight_ray forwards VLLM_* to the engine actor.
    monkeypatch.setenv("VLLM_RAY_BUNDLE_INDICES", "2,0")
    try:
        model = RayVLLM(model_dir, name="own-group", tensor_parallel_size=2, placement_group=group,
                        **ENGINE_KWARGS)
        try:
            ranks = sorted(model.topology(), key=lambda r: r["tp_rank"])
            assert [r["node_id"] for r in ranks] == [bundle_nodes[2], bundle_nodes[0]]
            assert [r["actor_name"] for r in ranks] == ["own-group.pp0.tp0", "own-group.pp0.tp1"]
            for got, want in zip(layers(model), layers(local_llama)):
                assert_close(got, want)
            assert request_counts(model) == [0, 0]
        finally:
            model.shutdown()
        assert placement_group_table(group)["state"] == "CREATED", "the caller's group was removed with the engine"
    finally:
        remove_placement_group(group)
