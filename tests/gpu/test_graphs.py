"""Graph modes (issue 23) on the GPU, against transformers on the same weights: raw saves, edits, fallbacks.

Two engines: ``RayVLLM(taps=[layers.*.output, layers.*.mlp.output, an o_proj inside layer 1's attention])`` (steps
whose blocks wait only on taps replay breakable graphs; others run eagerly)
and ``LocalVLLM(enforce_eager=False)`` (no taps: graphs on every step no block
needs). Every save is raw (no clone): a value saved on a replayed step is
that step's, not what the graph wrote there later (``_internal/blocks/snapshot.py``).
Each test also checks which way its steps ran (``step_modes()``).

Decode step k (k >= 1) processes the k-th generated token; its row is the
last position of ``prompt + generated[:k]`` in transformers' forward.
"""

from __future__ import annotations

import nnsight
import pytest
import torch

from .conftest import ENGINE_KWARGS, ON_GPU, TOL, assert_close

PROMPT = "The quick brown fox jumps over the lazy dog."
OTHER = "Hello, world!"
# and one operation inside a forward (``.source.``): layer 1's attention output projection
SOURCE_TAP = "model.layers.1.self_attn.source.self_o_proj_0.output"
TAPS = ["model.layers.*.output", "model.layers.*.mlp.output", SOURCE_TAP]
STEPS = 4  # prefill + 3 decode steps
GRAPH_KWARGS = dict(ENGINE_KWARGS, max_num_seqs=16)  # fewer graph sizes to capture: a faster start


@pytest.fixture(scope="module")
def ray_taps(head, gpu_model_dir):
    from nnsight_ray import RayVLLM

    model = RayVLLM(gpu_model_dir, name="gpu-taps", taps=TAPS, **GRAPH_KWARGS)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def local_graphs(gpu_model_dir):
    from nnsight_ray import LocalVLLM

    model = LocalVLLM(gpu_model_dir, dispatch=True, enforce_eager=False, **GRAPH_KWARGS)
    yield model
    model.shutdown()


@pytest.fixture(params=["ray_taps", "local_graphs"])
def graph_engine(request):
    return request.param, request.getfixturevalue(request.param)


def greedy(model, prompt: str, tokens: int = STEPS) -> tuple[list[int], list[int]]:
    """The prompt's token ids and the engine's greedy continuation (plain generate, no block)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    (output,) = model.vllm_entrypoint.generate([prompt], params)
    return list(output.prompt_token_ids), list(output.outputs[0].token_ids)


class Modes:
    """How the engine's steps ran between ``with`` entry and exit (rank 0)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.before = self.model.step_modes()[0]
        return self

    def __exit__(self, *exc):
        after = self.model.step_modes()[0]
        self.ran = {k: v - self.before.get(k, 0) for k, v in after.items() if v - self.before.get(k, 0)}
        print(f"\n[graph-modes] {self.ran}")

    def expect(self, ok: bool) -> None:
        """A claim about how steps ran; on the CPU build (no graphs: every step eager) only printed."""
        if ON_GPU:
            assert ok, self.ran


@pytest.mark.parametrize("where", ["layer", "inside"])
def test_a_raw_save_at_decode_step_k_matches_transformers(graph_engine, hf, where):
    """A tapped layer's output, or an operation inside a tapped forward (``.source.``:
    layer 1's attention output projection), saved raw at decode step 2."""
    kind, model = graph_engine
    prompt_ids, generated = greedy(model, PROMPT)
    with Modes(model) as modes:
        with model.trace(PROMPT, max_tokens=STEPS, temperature=0.0, ignore_eos=True) as tracer:
            for _ in tracer.iter[2]:
                layer = model.model.layers[1]
                out = (layer.output if where == "layer" else layer.self_attn.source.self_o_proj_0.output).save()
    record = hf.run_ids(prompt_ids + generated[:2])
    if where == "layer":
        got, want = (out[0] + out[1])[-1], record["layers"][1][-1]
    else:
        got, want = out[0][-1], record["attn_out"][1][-1]
    assert_close(got, want, what=f"{kind} layer 1 ({where}) at decode step 2")
    if kind == "ray_taps":  # the block waits on a tap every step: breakable graphs, then a full one
        modes.expect(modes.ran.get("piecewise", 0) >= 2 and "eager_for_block" not in modes.ran)
    else:  # no taps: eager while the block lives, graphs after it is done
        modes.expect(modes.ran.get("eager_for_block", 0) >= 3)
    modes.expect(modes.ran.get("graph", 0) >= 1)


def test_an_untapped_location_at_decode_step_k_is_served_by_an_eager_step(ray_taps, hf):
    prompt_ids, generated = greedy(ray_taps, PROMPT)
    with Modes(ray_taps) as modes:
        with ray_taps.trace(PROMPT, max_tokens=STEPS, temperature=0.0, ignore_eos=True) as tracer:
            for _ in tracer.iter[2]:
                mlp_in = ray_taps.model.layers[1].mlp.input.save()  # not a tap
    want = hf.run_ids(prompt_ids + generated[:2])["mlp_in"][1][-1]
    assert_close(mlp_in[-1], want, what="untapped mlp input at decode step 2")
    modes.expect(modes.ran.get("eager_for_block", 0) >= 3 and modes.ran.get("graph", 0) >= 1)


@pytest.mark.parametrize("how", ["in place", "replacing"])
def test_an_edit_of_a_tap_at_decode_step_k_is_seen_downstream_and_in_the_next_token(ray_taps, hf, how):
    prompt_ids, generated = greedy(ray_taps, PROMPT)
    with Modes(ray_taps) as modes:
        with ray_taps.trace(PROMPT, max_tokens=STEPS, temperature=0.0, ignore_eos=True) as tracer:
            for _ in tracer.iter[2]:
                if how == "in place":
                    ray_taps.model.layers[1].mlp.output[:] = 0
                else:
                    ray_taps.model.layers[1].mlp.output = ray_taps.model.layers[1].mlp.output * 0.5
                after = ray_taps.model.layers[2].output.save()
                logits = ray_taps.logits.save()
    scale = 0.0 if how == "in place" else 0.5

    def edit(i, out, _record):  # only the decode step's own row, as the engine edited it
        return torch.cat([out[:-1], out[-1:] * scale]) if i == 1 else None

    ids = prompt_ids + generated[:2]
    want, unedited = hf.run_ids(ids, edit=edit), hf.run_ids(ids)
    assert_close((after[0] + after[1])[-1], want["layers"][2][-1], what=f"{how} edit: layer 2 at step 2")
    assert_close(logits[-1], want["logits"], what=f"{how} edit: logits at step 2")
    assert (want["logits"] - unedited["logits"]).norm() > 10 * TOL * unedited["logits"].norm()
    modes.expect(modes.ran.get("piecewise", 0) >= 1 and "eager_for_block" not in modes.ran)


def test_every_step_of_a_tapped_layer_with_tracer_all(ray_taps, hf):
    prompt_ids, generated = greedy(ray_taps, PROMPT)
    with Modes(ray_taps) as modes:
        with ray_taps.trace(PROMPT, max_tokens=STEPS, temperature=0.0, ignore_eos=True) as tracer:
            outs = nnsight.save([])
            for _ in tracer.all():
                outs.append(ray_taps.model.layers[2].output)
    assert len(outs) == STEPS, len(outs)
    want = hf.run_ids(prompt_ids + generated[:STEPS - 1])["layers"][2]
    n = len(prompt_ids)
    assert_close(outs[0][0] + outs[0][1], want[:n], what="tracer.all() prefill")
    for k in range(1, STEPS):
        assert_close((outs[k][0] + outs[k][1])[-1], want[n + k - 1], what=f"tracer.all() decode step {k}")
    # The decode steps replay breakable graphs; vLLM runs this prefill eagerly itself (as measured on the H200).
    modes.expect(modes.ran.get("piecewise", 0) >= STEPS - 1 and "eager_for_block" not in modes.ran)


@pytest.mark.parametrize("what", ["a tapped layer", "an untapped input"])
def test_a_cache_records_every_step_after_its_block_is_done(graph_engine, hf, what):
    """``tracer.cache()`` outlives its block: a step with no live block must still reach what the cache keeps
    (a full graph would skip it). Taps alone: breakable graphs; anything else: eager steps."""
    kind, model = graph_engine
    prompt_ids, generated = greedy(model, PROMPT)
    layer = model.model.layers[1]
    with Modes(model) as modes:
        with model.trace(PROMPT, max_tokens=STEPS, temperature=0.0, ignore_eos=True) as tracer:
            if what == "a tapped layer":
                cache = tracer.cache(modules=[layer])
            else:  # the MLP's input is not a tap; its output is
                cache = tracer.cache(modules=[layer.mlp], include_inputs=True)
    want = hf.run_ids(prompt_ids + generated[:STEPS - 1])
    n = len(prompt_ids)
    if what == "a tapped layer":
        got = [out[0] + out[1] for out in cache["model.model.layers.1"].output]
        expected = want["layers"][1]
    else:
        got = cache["model.model.layers.1.mlp"].input
        expected = want["mlp_in"][1]
    assert len(got) == STEPS, f"{kind}: {len(got)} of {STEPS} steps cached"
    assert_close(got[0], expected[:n], what=f"{kind} cache of {what}, prefill")
    for k in range(1, STEPS):
        assert_close(got[k][-1], expected[n + k - 1], what=f"{kind} cache of {what}, decode step {k}")
    if kind == "ray_taps" and what == "a tapped layer":
        # decode steps at the taps of breakable graphs; the prompt's step eagerly (its rows come from forward
        # hooks, which a graph never runs: on an H100, {'piecewise': 3, 'eager_for_block': 1})
        modes.expect(modes.ran.get("piecewise", 0) >= STEPS - 1 and modes.ran.get("eager_for_block", 0) <= 1)
    else:
        modes.expect(modes.ran.get("eager_for_block", 0) >= STEPS - 1)


def test_a_registered_block_on_plain_generate_leaves_decode_to_full_graphs(ray_taps, hf):
    with ray_taps.edit() as (tracer, edit):
        first = ray_taps.model.layers[0].output.save()  # noqa: F841 - the registered save
    try:
        with Modes(ray_taps) as modes:
            outputs = ray_taps.generate([PROMPT, OTHER], max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    finally:
        edit.clear()
    for prompt, output in zip([PROMPT, OTHER], outputs):
        got = output.saves["first"]
        assert_close(got[0] + got[1], hf.run(prompt)["layers"][0], what=f"registered layer 0 of {prompt!r}")
    modes.expect(modes.ran.get("graph", 0) >= STEPS - 1 and "eager_for_block" not in modes.ran)


def test_plain_requests_share_graph_steps_with_a_traced_one(ray_taps, hf):
    """Several requests in one step where only one has a block: the block's value and the others' tokens."""
    alone = greedy(ray_taps, OTHER)[1]
    prompt_ids, generated = greedy(ray_taps, PROMPT)
    with Modes(ray_taps) as modes:
        with ray_taps.trace(PROMPT, max_tokens=STEPS, temperature=0.0, ignore_eos=True, blocking=False) as tracer:
            for _ in tracer.iter[2]:
                out = ray_taps.model.layers[1].output.save()
        plain = ray_taps.generate([OTHER] * 3, max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        got = tracer.collect()["out"]
    assert [list(o.outputs[0].token_ids) for o in plain] == [alone] * 3
    want = hf.run_ids(prompt_ids + generated[:2])["layers"][1][-1]
    assert_close((got[0] + got[1])[-1], want, what="traced request beside plain ones")
    modes.expect(modes.ran.get("piecewise", 0) >= 1)


@pytest.mark.parametrize("locations", [["model.layers.1.output", "model.layers.2.output"],
                                       ["model.layers.1.output", "model.layers.1.self_attn.output"]],
                         ids=["taps", "an untapped one"])
def test_extraction_of_generated_tokens_on_a_tapped_engine(ray_taps, hf, tmp_path, locations):
    """``extract_async(generated=True)``: a decode step's rows are taken at the taps of a breakable graph
    when every asked location is a tap (no eager step), else the step runs eagerly (forward hooks)."""
    import ray
    from safetensors.torch import load_file

    engine = ray_taps.vllm_entrypoint
    with Modes(ray_taps) as modes:
        outputs = ray.get(engine.extract_async([PROMPT, OTHER], "gen", str(tmp_path), locations, max_tokens=STEPS,
                                               generated=True, ignore_eos=True))
    (written,) = [w for w in ray.get(engine.extract_commit("gen")) if w is not None]
    data = load_file(written["file"])
    for index, output in enumerate(outputs):
        sequence = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)[:-1]
        rows = data["prompt_index"] == index
        assert data["token_ids"][rows].tolist() == sequence
        want = hf.run_ids(sequence)
        assert_close(data["model.layers.1.output"][rows], want["layers"][1], what=f"generated rows of prompt {index}")
    if not any("self_attn" in location for location in locations):
        # decode steps at the taps of breakable graphs; the prompt's step eagerly (its rows come from forward
        # hooks, which a graph never runs: on an H100, {'piecewise': 3, 'eager_for_block': 1})
        modes.expect(modes.ran.get("piecewise", 0) >= STEPS - 1 and modes.ran.get("eager_for_block", 0) <= 1)
    else:
        modes.expect(modes.ran.get("eager_for_block", 0) >= STEPS - 1)
