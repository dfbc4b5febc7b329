"""LocalVLLM and RayVLLM on the GPU, against transformers on the same weights.

Every save here is *raw* (no ``.clone()``): vLLM's CUDA kernels write the
tensors a block was handed in place (``_internal/blocks/snapshot.py``), so these are
the tests that a saved value is what the model produced at that moment.

vLLM's ``LlamaDecoderLayer`` returns ``(hidden, residual)`` with the residual
add deferred to the next layer's fused norm: their sum is the residual stream,
which is what transformers' decoder layer returns.
"""

from __future__ import annotations

import asyncio
import time

import nnsight
import pytest
import ray

from reference import assert_outputs_as_results

from .conftest import ON_GPU, TOL, assert_close

PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog."]
LAYERS = 4


@pytest.fixture(params=["local", "ray"])
def engine(request):
    model = request.getfixturevalue("local" if request.param == "local" else "rayvllm")
    yield request.param, model
    counts = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        counts = model.vllm_entrypoint.collective_rpc("nnsight_request_count")
        if counts and all(c == 0 for c in counts):
            break
        time.sleep(0.5)
    assert counts and all(c == 0 for c in counts), f"requests left tracked: {counts}"


def _on_caller(kind: str, value) -> None:
    """RayVLLM's saves cross the object store and arrive on the CPU (no GPU needed at the caller)."""
    if kind == "ray":
        assert value.device.type == "cpu", value.device


def test_raw_saves_of_every_layer_and_the_logits_match_transformers(engine, hf):
    kind, model = engine
    with model.trace(PROMPTS[1], temperature=0.0, max_tokens=1):
        outs = nnsight.save([])
        for i in range(LAYERS):
            outs.append(model.model.layers[i].output)
        logits = model.logits.save()
    want = hf.run(PROMPTS[1])
    for i, (hidden, residual) in enumerate(outs):
        _on_caller(kind, hidden)
        assert_close(hidden + residual, want["layers"][i], what=f"{kind} layer {i} residual stream")
    assert_close(logits[-1], want["logits"], what=f"{kind} logits")


def test_raw_saves_of_module_inputs_match_transformers(engine, hf):
    kind, model = engine
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
        mlp_in = nnsight.save([])
        for i in range(LAYERS):
            if i == 2:
                layer_in = model.model.layers[2].inputs.save()  # ((positions, hidden, residual), {})
            mlp_in.append(model.model.layers[i].mlp.input)
    want = hf.run(PROMPTS[0])
    for i in range(LAYERS):
        assert_close(mlp_in[i], want["mlp_in"][i], what=f"{kind} layer {i} mlp input")
    args = layer_in[0]
    hidden, residual = args[1], args[2]
    assert_close(hidden + residual, want["layers"][1], what=f"{kind} layer 2 input = layer 1 output")


def test_an_edit_is_seen_downstream(engine, hf):
    kind, model = engine
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
        model.model.layers[1].mlp.output[:] = 0
        after = model.model.layers[2].output.save()
        logits = model.logits.save()
    want = hf.run(PROMPTS[0], edit=lambda i, out, _: out * 0 if i == 1 else None)
    unedited = hf.run(PROMPTS[0])
    assert_close(after[0] + after[1], want["layers"][2], what=f"{kind} layer 2 after the edit")
    assert_close(logits[-1], want["logits"], what=f"{kind} logits after the edit")
    assert (want["logits"] - unedited["logits"]).norm() > 10 * TOL * unedited["logits"].norm()


def test_a_cross_layer_dependency(engine, hf):
    kind, model = engine
    with model.trace(PROMPTS[1], temperature=0.0, max_tokens=1):
        early = model.model.layers[0].mlp.output  # held while layers 1-3 run
        model.model.layers[3].mlp.output[:] += early
        logits = model.logits.save()

    def edit(i, out, record):
        return out + record["mlp_out"][0] if i == 3 else None

    assert_close(logits[-1], hf.run(PROMPTS[1], edit=edit)["logits"], what=f"{kind} logits, layer 3 += layer 0")


def test_multi_invoke_gives_each_prompt_its_own_values(engine, hf):
    kind, model = engine
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(PROMPTS[0]):
            a = model.model.layers[2].output.save()
        with tracer.invoke(PROMPTS[1]):
            b = model.model.layers[2].output.save()
            logits_b = model.logits.save()
    assert_close(a[0] + a[1], hf.run(PROMPTS[0])["layers"][2], what=f"{kind} invoke 0")
    want_b = hf.run(PROMPTS[1])
    assert_close(b[0] + b[1], want_b["layers"][2], what=f"{kind} invoke 1")
    assert_close(logits_b[-1], want_b["logits"], what=f"{kind} invoke 1 logits")


def test_registered_block_on_plain_generate(rayvllm, hf):
    kind, model = "ray", rayvllm
    with model.edit() as (tracer, edit):
        first = model.model.layers[0].output.save()
        last = model.model.layers[LAYERS - 1].output.save()
    try:
        outputs = model.generate(PROMPTS, max_tokens=1, temperature=0.0)
    finally:
        edit.clear()
    for prompt, output in zip(PROMPTS, outputs):
        want = hf.run(prompt)
        got_first, got_last = output.saves["first"], output.saves["last"]
        assert_close(got_first[0] + got_first[1], want["layers"][0], what=f"{kind} registered first layer")
        assert_close(got_last[0] + got_last[1], want["layers"][LAYERS - 1], what=f"{kind} registered last layer")
    assert all(not o.saves for o in model.generate(PROMPTS, max_tokens=1, temperature=0.0))


def test_an_intervention_error_reaches_the_caller_and_the_engine_goes_on(engine, hf):
    kind, model = engine
    with pytest.raises(Exception, match="boom"):
        with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
            model.model.layers[0].output.save()
            raise ValueError("boom")
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
        logits = model.logits.save()
    assert_close(logits[-1], hf.run(PROMPTS[0])["logits"], what=f"{kind} after an error")


# -- RayVLLM only ---------------------------------------------------------------


def test_a_runaway_block_is_stopped_and_its_neighbours_keep_their_values(rayvllm, hf):
    """A block that never parks is stopped on the GPU rank after its budget; eight traces beside it are exact."""
    with rayvllm.trace(PROMPTS[0], temperature=0.0, max_tokens=2, blocking=False, block_timeout_s=1.0) as bad:
        first = rayvllm.model.layers[0].output[0].clone().save()  # noqa: F841
        i = 0
        while True:
            i += 1
    time.sleep(0.3)
    began = time.monotonic()
    neighbours = []
    for prompt in (PROMPTS * 8)[:8]:
        with rayvllm.trace(prompt, temperature=0.0, max_tokens=1, blocking=False) as tracer:
            logits = rayvllm.logits.save()  # noqa: F841
        neighbours.append((prompt, tracer))
    for prompt, tracer in neighbours:
        assert_close(tracer.collect(timeout=120)["logits"][-1], hf.run(prompt)["logits"], what="a neighbour")
    assert time.monotonic() - began < 1.0 + 5
    with pytest.raises(TimeoutError, match="block_timeout_s=1 "):
        bad.collect(timeout=120)


def test_an_out_of_memory_in_a_block_fails_its_request_and_the_kv_cache_survives(engine, hf):
    """A block asking the GPU for a petabyte gets torch's OutOfMemoryError as its own request's error; the
    engine's KV cache (allocated at start) is untouched, so the next trace's logits are exact."""
    kind, model = engine
    with pytest.raises(Exception, match="out of memory|OutOfMemoryError") as failed:
        with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
            first = model.model.layers[0].output[0]
            import torch as t

            t.empty(1 << 50, dtype=t.uint8, device=first.device)
    assert isinstance(failed.value, RuntimeError)
    with model.trace(PROMPTS[1], temperature=0.0, max_tokens=1):
        logits = model.logits.save()
    assert_close(logits[-1], hf.run(PROMPTS[1])["logits"], what=f"{kind} after an out-of-memory")


def test_non_blocking_ref_resolves_here_and_in_a_task(rayvllm, hf):
    with rayvllm.trace(PROMPTS[0], temperature=0.0, max_tokens=1, blocking=False) as tracer:
        out = rayvllm.model.layers[2].output.save()
    assert isinstance(tracer.ref, ray.ObjectRef)

    @ray.remote(num_cpus=0)
    def stream_norm(saves):
        hidden, residual = saves["out"]
        return float((hidden + residual).norm()), str(hidden.device)

    want = hf.run(PROMPTS[0])["layers"][2]
    norm, device = ray.get(stream_norm.remote(tracer.ref), timeout=120)
    assert device == "cpu"
    assert abs(norm - float(want.norm())) < TOL * float(want.norm())
    got = tracer.collect()["out"]
    assert_close(got[0] + got[1], want, what="non-blocking collect")


def test_outputs_come_home_with_raw_saves(rayvllm, hf):
    """trace(blocking=False, outputs=True) on the GPU: raw saves equal transformers', and each invoke's
    prompt ids, tokens and text equal what ``tracer.result`` reads in a blocking trace."""
    with rayvllm.trace(temperature=0.0, max_tokens=3, blocking=False, outputs=True) as tracer:
        hidden = nnsight.save([None, None])
        for i, prompt in enumerate(PROMPTS):
            with tracer.invoke(prompt):
                hidden[i] = rayvllm.model.layers[2].output
    values, outputs = tracer.collect()
    assert_outputs_as_results(outputs, rayvllm, PROMPTS, temperature=0.0, max_tokens=3)
    for i, prompt in enumerate(PROMPTS):
        got = values["hidden"][i]
        _on_caller("ray", got[0])
        assert_close(got[0] + got[1], hf.run(prompt)["layers"][2], what=f"outputs=True invoke {i}")


def test_async_stream_yields_every_step_and_raw_saves_on_the_last(rayvllm, hf):
    from nnsight_ray import RayVLLM

    model = RayVLLM.connect("gpu-tp1", mode="async")

    async def run():
        with model.trace(PROMPTS[1], temperature=0.0, max_tokens=4) as tracer:
            out = model.model.layers[1].output.save()
        return [o async for o in tracer.backend]

    seen = asyncio.run(run())
    # vLLM merges steps a lagging consumer has not taken yet: up to 4 outputs
    assert 1 <= len(seen) <= 4 and [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    hidden, residual = seen[-1].saves["out"]
    assert_close(hidden + residual, hf.run(PROMPTS[1])["layers"][1], what="async stream")


def test_topology_puts_the_rank_on_a_gpu_bundle(rayvllm):
    (rank,) = rayvllm.topology()
    assert rank["actor_name"] == "gpu-tp1.pp0.tp0"
    assert rank["gc_frozen"] > 100_000, rank["gc_frozen"]  # vLLM's worker froze its heap after warm-up
    health = rayvllm.health()
    assert health["alive"], health
    for merge in rayvllm.vllm_entrypoint.merges:  # on the H200 a merge actor's heap once stayed unfrozen
        stats = ray.get(merge.stats.remote(), timeout=60)
        assert stats["gc_unfrozen"] < 50_000, stats  # what a full collection there scans (770k before the fix)
    if ON_GPU:
        from ray.util.state import list_actors

        (actor,) = [a for a in list_actors(filters=[("name", "=", "gpu-tp1.pp0.tp0")], detail=True)
                    if a.state == "ALIVE"]
        # Inside a placement group Ray names the resource after the group (GPU_group_<id>).
        gpus = sum(v for k, v in (actor.required_resources or {}).items() if k == "GPU" or k.startswith("GPU_group_"))
        assert gpus >= 1, actor.required_resources


@pytest.mark.parametrize("staging", ["cache", "ring", "pool"])
def test_extraction_files_match_transformers(rayvllm, hf, tmp_path, staging):
    """Rank-written activations (issue 24) on CUDA: every prompt token of every layer, in place-safe,
    whichever way the rows wait on the host (``host_memory``: PyTorch's pinned cache, the ring copied
    out to mapped buffers, a fixed pool of slabs).

    The capture copies a layer's rows in its forward hook, before the next layer's fused norm
    updates the layer's output in place; the copy to the host runs on a side stream.
    """
    from safetensors.torch import load_file

    locations = [f"model.layers.{i}.output" for i in range(LAYERS)]
    engine = rayvllm.vllm_entrypoint
    assert engine.collective_rpc("nnsight_ray_extract_staging", args=(staging,)) == [staging]
    try:
        ray.get(engine.extract_async(PROMPTS, "gpu-part", str(tmp_path), locations))
        (written,) = [w for w in ray.get(engine.extract_commit("gpu-part")) if w is not None]
        (held,) = engine.collective_rpc("nnsight_ray_extract_memory")
        assert held["parts"] == 0 and held["host_mb"] == 0, held
    finally:
        engine.collective_rpc("nnsight_ray_extract_staging", args=("pool",))  # the default
    data = load_file(written["file"])
    for index, prompt in enumerate(PROMPTS):
        rows = data["prompt_index"] == index
        want = hf.run(prompt)
        assert data["token_ids"][rows].tolist() == hf.tokenizer.encode(prompt)
        for i, location in enumerate(locations):
            assert_close(data[location][rows], want["layers"][i], what=f"extracted layer {i}, prompt {index}")


def test_extraction_of_generated_tokens_matches_transformers(rayvllm, hf, tmp_path):
    """``generated=True`` on CUDA: each decode step's row too, its token read from the forward's input ids
    on the device (async scheduling keeps the last sampled token there), against transformers over the
    prompt and the generated tokens."""
    from safetensors.torch import load_file

    locations = [f"model.layers.{i}.output" for i in range(LAYERS)]
    engine = rayvllm.vllm_entrypoint
    outputs = ray.get(engine.extract_async(PROMPTS, "gpu-gen", str(tmp_path), locations, max_tokens=6,
                                           generated=True, ignore_eos=True))
    (written,) = [w for w in ray.get(engine.extract_commit("gpu-gen")) if w is not None]
    (held,) = engine.collective_rpc("nnsight_ray_extract_memory")
    assert held["parts"] == 0 and held["host_mb"] == 0, held
    data = load_file(written["file"])
    for index, output in enumerate(outputs):
        sequence = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)[:-1]
        rows = data["prompt_index"] == index
        assert data["token_ids"][rows].tolist() == sequence
        assert data["position"][rows].tolist() == list(range(len(sequence)))
        want = hf.run_ids(sequence)
        for i, location in enumerate(locations):
            assert_close(data[location][rows], want["layers"][i], what=f"generated rows, layer {i}, prompt {index}")
