"""Generated-token extraction while vLLM preempts: a request pushed out of a full KV cache comes back and
recomputes its prompt and generated tokens in one step; its rows must still be each position once, equal
to a prefill of its sequence.

An engine of its own (a KV cache of 512 tokens: two whole sequences of 256), fed 8 requests that each
grow to ~230 tokens: vLLM admits them on their prompts' blocks and preempts as they grow. Measured on the
2-core machine: 8 prompts x 200 tokens, recomputes of 128-129 tokens, every row exact.
"""

from __future__ import annotations

import pytest
import ray
import torch

from conftest import ENGINE_KWARGS, assert_close

pytestmark = pytest.mark.integration

LOCATIONS = ["model.layers.1.output", "model.layers.3.output"]


@pytest.fixture(scope="module")
def small_cache(request, ray_cluster, model_dir):
    from nnsight_ray import RayVLLM

    model = RayVLLM(model_dir, name="preempt", **{**ENGINE_KWARGS, "kv_cache_memory_bytes": 2 << 20})
    yield model
    model.shutdown()


def test_a_recomputed_request_writes_each_position_once_and_equal_to_a_prefill(small_cache, tmp_path):
    from safetensors.torch import load_file

    engine = small_cache.vllm_entrypoint
    prompts = [f"prompt {i}: the quick brown fox" for i in range(8)]
    outputs = ray.get(engine.extract_async(prompts, "gen", str(tmp_path), LOCATIONS, max_tokens=200,
                                           generated=True, ignore_eos=True))
    (written,) = [w for w in ray.get(engine.extract_commit("gen")) if w is not None]
    assert written["replayed"] > 0, "no request was recomputed: the cache is not small enough to preempt"
    data = load_file(written["file"])
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:-1] for o in outputs]
    assert written["rows"] == sum(len(s) for s in sequences)
    # the reference: each whole sequence as one prefill on the same engine (nothing else in flight)
    for index, sequence in enumerate(sequences):
        rows = data["prompt_index"] == index
        assert data["token_ids"][rows].tolist() == sequence
        assert data["position"][rows].tolist() == list(range(len(sequence)))
        ray.get(engine.extract_async([{"prompt_token_ids": sequence}], f"ref{index}", str(tmp_path), LOCATIONS))
        (reference,) = [w for w in ray.get(engine.extract_commit(f"ref{index}")) if w is not None]
        want = load_file(reference["file"])
        for location in LOCATIONS:
            assert_close(data[location][rows], want[location])
    held = engine.collective_rpc("nnsight_ray_extract_memory")
    assert all(h["parts"] == 0 and h["writing"] == 0 and h["host_mb"] == 0 for h in held), held
