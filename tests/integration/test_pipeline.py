"""Traces written against the whole model on pipeline-parallel engines (Ray rank actors).

Each case runs the same trace on a pipeline engine and on the single-device
reference (``local_llama``) and compares: values within 1e-3 relative, the same
greedy tokens. The tiny Llama has 4 layers, so at ``pipeline_parallel_size=2``
layers 0-1 (and the embedding) run on stage 0 and layers 2-3, the final norm and
the logits on stage 1.

Three pipeline layouts, one at a time (a parametrized module fixture, so each
is shut down before the next starts): PP=2, TP=2 x PP=2, and PP=3, whose middle
stage both receives recordings and sends them on (layers 0 | 1-2 | 3).
"""

from __future__ import annotations

import sys

import cloudpickle
import nnsight
import pytest
import torch

from conftest import ENGINE_KWARGS, assert_close, request_counts

pytestmark = pytest.mark.integration

# Blocks below call this module's helpers (``residual``, the edits); ship them
# by value, since the engine's workers cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPT = "Hello world"
N_LAYERS = 4


LAYOUTS = {
    "pp2": {"pipeline_parallel_size": 2},
    "tp2pp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    "pp3": {"pipeline_parallel_size": 3},
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pp(request, ray_cluster, model_dir):
    from nnsight_ray import LocalVLLM

    layout = LAYOUTS[request.param]
    groups_before = live_placement_groups()
    model = LocalVLLM(
        model_dir,
        dispatch=True,
        distributed_executor_backend="ray",
        placement_strategy="SPREAD",
        **layout,
        **ENGINE_KWARGS,
    )
    yield model
    model.shutdown()
    # the ranks' placement group was reserved here; shutdown hands it back
    assert live_placement_groups() <= groups_before


def live_placement_groups() -> set[str]:
    import ray

    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


@pytest.fixture
def ref(local_llama):
    return local_llama


@pytest.fixture(autouse=True)
def no_requests_left_behind(request):
    yield
    for name in ("pp", "local_llama"):
        if name in request.fixturenames:
            counts = request_counts(request.getfixturevalue(name))
            assert counts and all(count == 0 for count in counts), f"{name}: requests left tracked: {counts}"


def residual(model, i: int) -> torch.Tensor:
    """Layer ``i``'s residual stream (vLLM's Llama layer returns ``(hidden, residual)``)."""
    out = model.model.layers[i].output
    return (out[0] + out[1]).clone()


# --- 1. reads on every stage -------------------------------------------------


def read_everything(model, prompt: str = PROMPT) -> dict:
    with model.trace(prompt, temperature=0.0, max_tokens=3) as tracer:
        embed = model.model.embed_tokens.output.clone().save()
        layers = nnsight.save([residual(model, i) for i in range(N_LAYERS)])
        norm = model.model.norm.output[0].clone().save()
        logits = model.logits.clone().save()
        samples = model.samples.clone().save()
        result = tracer.result.save()
    return {
        "layers": layers,
        "embed": embed,
        "norm": norm,
        "logits": logits,
        "samples": samples,
        "tokens": list(result.outputs[0].token_ids),
    }


def test_reads_on_every_stage(pp, ref):
    got, want = read_everything(pp), read_everything(ref)
    assert got["tokens"] == want["tokens"]
    for i in range(N_LAYERS):
        assert_close(got["layers"][i], want["layers"][i])
    for name in ("embed", "norm", "logits"):
        assert not isinstance(got[name], nnsight_ghost_type()), f"{name} came back as a placeholder"
        assert_close(got[name], want[name])
    assert torch.equal(got["samples"], want["samples"])


def nnsight_ghost_type() -> type:
    from nnsight_ray._internal.pipeline import Ghost

    return Ghost


def test_several_prompts_in_one_trace(pp, ref):
    def run(model):
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke("Hi there"):
                a0 = residual(model, 0).save()
                a3 = residual(model, 3).save()
            with tracer.invoke("The quick brown fox"):
                b1 = residual(model, 1).save()
                b2 = residual(model, 2).save()
                bl = model.logits.clone().save()
        return [a0, a3, b1, b2, bl]

    for got, want in zip(run(pp), run(ref)):
        assert_close(got, want)


# --- 2. edits on any stage -----------------------------------------------------


def edited(model, edit, read: tuple = (2, 3)) -> dict:
    with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        edit(model)
        late = nnsight.save([residual(model, i) for i in read])
        logits = model.logits.clone().save()
        result = tracer.result.save()
    return {"late": late, "logits": logits, "tokens": list(result.outputs[0].token_ids)}


def scale_first_layer(model):
    model.model.layers[0].output[0][:] *= 3.0


def swap_second_layer(model):
    hidden, res = model.model.layers[1].output
    model.model.layers[1].output = (hidden * -1.0, res)


@pytest.mark.parametrize("edit", [scale_first_layer, swap_second_layer])
def test_edit_on_first_stage_changes_later_stages(pp, ref, edit):
    got, want = edited(pp, edit), edited(ref, edit)
    plain = read_everything(ref)
    assert not torch.allclose(want["logits"], plain["logits"]), "the edit should change the logits"
    assert got["tokens"] == want["tokens"]
    assert_close(got["logits"], want["logits"])
    for g, w in zip(got["late"], want["late"]):
        assert_close(g, w)


def test_edit_on_last_stage(pp, ref):
    def zero_layer_two(model):
        model.model.layers[2].output[0][:] = 0

    got, want = edited(pp, zero_layer_two), edited(ref, zero_layer_two)
    assert got["tokens"] == want["tokens"]
    assert_close(got["logits"], want["logits"])


# --- 3. cross-stage dependencies ------------------------------------------------


def test_value_from_stage_zero_used_on_stage_one(pp, ref):
    def add_layer_one(model):
        h = model.model.layers[1].output[0].clone()
        model.model.layers[3].output[0][:] += h

    got, want = edited(pp, add_layer_one, read=(3,)), edited(ref, add_layer_one, read=(3,))
    plain = read_everything(ref)
    assert not torch.allclose(want["logits"], plain["logits"])
    assert got["tokens"] == want["tokens"]
    assert_close(got["logits"], want["logits"])
    for g, w in zip(got["late"], want["late"]):
        assert_close(g, w)


def test_later_value_read_from_earlier_code_is_ordered_by_the_forward(pp, ref):
    """Reading layer 3 and then layer 0 in one step is out of order on one device, and here."""

    def run(model):
        with model.trace(PROMPT, temperature=0.0, max_tokens=1):
            b = residual(model, 3).save()
            a = residual(model, 0).save()
        return a, b

    with pytest.raises(Exception, match="OutOfOrderError") as on_one_device:
        run(ref)
    with pytest.raises(Exception, match="OutOfOrderError") as on_pipeline:
        run(pp)
    assert "model.model.layers.0.output" in str(on_one_device.value) and "model.model.layers.0.output" in str(on_pipeline.value)


# --- 4. generation ----------------------------------------------------------------


def generate_all(model, steps: int = 4) -> dict:
    with model.trace("Hello", temperature=0.0, max_tokens=steps) as tracer:
        early = nnsight.save([])
        late = nnsight.save([])
        logits = nnsight.save([])
        samples = nnsight.save([])
        for step in tracer.all():
            early.append(residual(model, 1))
            late.append(residual(model, 3))
            logits.append(model.logits.clone())
            samples.append(model.samples.clone())
        # (the open loop ends when generation does; nothing after it runs)
    return {"early": early, "late": late, "logits": logits, "samples": samples}


def test_generation_all_steps_on_both_stages(pp, ref):
    got, want = generate_all(pp), generate_all(ref)
    assert len(got["early"]) == len(want["early"]) == 4
    assert [s.tolist() for s in got["samples"]] == [s.tolist() for s in want["samples"]]
    for key in ("early", "late", "logits"):
        for step, (g, w) in enumerate(zip(got[key], want[key])):
            assert_close(g, w), (key, step)


def test_generation_with_a_dependency_every_step(pp, ref):
    def run(model):
        with model.trace("Hello", temperature=0.0, max_tokens=4) as tracer:
            samples = nnsight.save([])
            late = nnsight.save([])
            for step in tracer.all():
                h = model.model.layers[1].output[0].clone()
                model.model.layers[3].output[0][:] += h
                late.append(residual(model, 3))
                samples.append(model.samples.clone())
        return samples, late

    (got_samples, got_late), (want_samples, want_late) = run(pp), run(ref)
    assert [s.tolist() for s in got_samples] == [s.tolist() for s in want_samples]
    for g, w in zip(got_late, want_late):
        assert_close(g, w)


def test_iter_selected_steps(pp, ref):
    def run(model):
        with model.trace("Hello", temperature=0.0, max_tokens=4) as tracer:
            picked = nnsight.save([])
            for step in tracer.iter[1:3]:
                model.model.layers[0].output[0][:] *= 0.5  # an edit on stage 0 at steps 1 and 2 only
                picked.append(residual(model, 2))
                picked.append(model.logits.clone())
            result = tracer.result.save()
        return picked, list(result.outputs[0].token_ids)

    (got, got_tokens), (want, want_tokens) = run(pp), run(ref)
    assert got_tokens == want_tokens and len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert_close(g, w)


def test_registered_block_spanning_stages(pp, ref):
    def run(model):
        with model.edit() as (tracer, edit):
            a = model.model.layers[0].output[0].clone().save()
            b = model.model.layers[3].output[0].clone().save()
        try:
            outputs = model.generate(["Hello world", "Hi"], max_tokens=2, temperature=0.0)
        finally:
            edit.clear()
        return [(o.saves["a"], o.saves["b"], list(o.outputs[0].token_ids)) for o in outputs]

    for (ga, gb, gt), (wa, wb, wt) in zip(run(pp), run(ref)):
        assert gt == wt
        assert_close(ga, wa)
        assert_close(gb, wb)
    # Cleared on every stage: the next request carries no copies.
    outputs = pp.generate(["Hi"], max_tokens=1, temperature=0.0)
    assert not getattr(outputs[0], "saves", {})


# --- 5. clear failures ------------------------------------------------------------


def test_error_on_second_stage_reaches_the_caller(pp):
    from nnsight_ray.errors import RequestError

    with pytest.raises(RequestError, match="mat1 and mat2 shapes cannot be multiplied"):
        with pp.trace(PROMPT, temperature=0.0, max_tokens=3):
            hidden = pp.model.layers[3].output[0]
            (hidden @ torch.ones(3, 3)).save()
    # The engine serves the next trace normally.
    assert read_everything(pp)["tokens"]


def test_edit_from_a_later_stages_value_fails_clearly(pp):
    from nnsight_ray.errors import RequestError

    with pytest.raises(RequestError) as caught:
        with pp.trace("Hello", temperature=0.0, max_tokens=3) as tracer:
            previous = None
            for step in tracer.all():
                if step:
                    pp.model.layers[0].output[0][:] += previous
                previous = pp.model.layers[3].output[0][-1].clone()
    text = str(caught.value)
    assert "PipelineDependencyError" in text
    assert "model.model.layers.0.output on pipeline stage 0 depends on model.model.layers.3.output" in text


def test_control_flow_on_a_later_stages_value_fails_clearly(pp, ref):
    def run(model):
        with model.trace("Hello", temperature=0.0, max_tokens=3) as tracer:
            out = nnsight.save([])
            for step in tracer.all():
                out.append(residual(model, 1))
                if model.model.layers[3].output[0].sum() > 0:
                    out.append(residual(model, 3))
        return out

    assert len(run(ref)) >= 3  # fine on one device
    with pytest.raises(Exception) as caught:
        run(pp)
    text = str(caught.value)
    assert "PipelineDependencyError" in text and "needs the value of model.model.layers.1.output" in text
    assert "at step 1" in text and "GhostStop: bool() of model.model.layers.3.output" in text
