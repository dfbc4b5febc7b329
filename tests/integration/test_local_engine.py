"""``LocalVLLM`` on vLLM's CPU engine, checked against HuggingFace transformers.

One float32 engine per architecture for the whole module (each costs ~30 s to
start). References come from transformers' own forward on the same checkpoint,
in this process.

Token ids: the checkpoints' character-level tokenizer adds no BOS, and vLLM
tokenizes with the same tokenizer, so vLLM's ``prompt_token_ids`` equal
``tokenizer.encode(prompt)`` (checked in ``test_prompt_ids_match_tokenizer``);
HF is fed exactly those ids.

What a decoder layer returns differs between the two stacks:

- vLLM's ``LlamaDecoderLayer`` returns ``(hidden, residual)`` with the residual
  add deferred to the next layer's fused norm; their sum is the residual stream,
  which is what HF's ``LlamaDecoderLayer`` returns.
- vLLM's ``GPT2Block`` returns the residual stream itself, as HF's does.

HF's ``hidden_states[-1]`` has the final norm applied, so references are taken
with forward hooks on HF's decoder layers rather than from ``hidden_states``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ENGINE_KWARGS, multi_invoke  # at import time: see tests/unit/conftest.py
from nnsight_ray.errors import RequestError

pytestmark = pytest.mark.integration

REL_TOL = 1e-3
PROMPT = "Hello, world!"
SHORT = "Hi"
LONG = "The quick brown fox jumps over the lazy dog."


# --- fixtures ---------------------------------------------------------------


def _engine(path: str):
    from nnsight_ray.local import LocalVLLM

    return LocalVLLM(path, dispatch=True, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def llama(local_llama):
    """The session's single-device reference engine (one engine start fewer)."""
    return local_llama


@pytest.fixture(scope="module")
def gpt2(gpt2_dir):
    model = _engine(gpt2_dir)
    yield model
    model.shutdown()


@pytest.fixture(autouse=True)
def no_requests_left_behind(request):
    """Every test leaves no request tracked on any rank of the engines it used."""
    yield
    for name in ("llama", "gpt2"):
        if name in request.fixturenames:
            model = request.getfixturevalue(name)
            counts = model.vllm_entrypoint.collective_rpc("nnsight_request_count")
            assert counts and all(count == 0 for count in counts), f"{name}: requests left tracked: {counts}"


class HFReference:
    """transformers' forward on a checkpoint: every decoder layer's output and the last logits."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.layers = self.model.get_decoder().layers if hasattr(self.model.get_decoder(), "layers") else self.model.transformer.h

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    @torch.no_grad()
    def __call__(self, prompt: str):
        outs: list[torch.Tensor] = []
        hooks = [
            layer.register_forward_hook(lambda _m, _i, out: outs.append((out[0] if isinstance(out, tuple) else out)[0]))
            for layer in self.layers
        ]
        try:
            logits = self.model(torch.tensor([self.ids(prompt)])).logits[0, -1]
        finally:
            for hook in hooks:
                hook.remove()
        return outs, logits


@pytest.fixture(scope="module")
def hf_llama(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def hf_gpt2(gpt2_dir):
    return HFReference(gpt2_dir)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def assert_close(actual, expected, tol: float = REL_TOL) -> None:
    err = rel_err(actual, expected)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def residual_stream(llama_layer_output) -> torch.Tensor:
    hidden, residual = llama_layer_output
    return hidden + residual


# --- against HF -------------------------------------------------------------


def test_prompt_ids_match_tokenizer(llama, hf_llama):
    with llama.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
        result = tracer.result.save()
    ids = hf_llama.ids(PROMPT)
    assert hf_llama.tokenizer.bos_token_id not in ids  # no BOS on either side
    assert list(result.prompt_token_ids) == ids == llama.tokenizer.encode(PROMPT)


def test_llama_layers_and_logits_match_hf(llama, hf_llama):
    n = len(hf_llama.layers)
    with llama.trace(PROMPT, temperature=0.0, max_tokens=1):
        outs = list().save()
        for i in range(n):
            outs.append(llama.model.layers[i].output)
        logits = llama.logits.save()
    ref_outs, ref_logits = hf_llama(PROMPT)
    for i in range(n):
        assert isinstance(outs[i], tuple) and len(outs[i]) == 2
        assert outs[i][0].shape == (len(PROMPT), 128)
        assert_close(residual_stream(outs[i]), ref_outs[i])
    assert logits.shape == (1, hf_llama.model.config.vocab_size)
    assert_close(logits[0], ref_logits)


def test_gpt2_blocks_and_logits_match_hf(gpt2, hf_gpt2):
    n = len(hf_gpt2.layers)
    with gpt2.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
        outs = list().save()
        for i in range(n):
            outs.append(gpt2.transformer.h[i].output)
        logits = gpt2.logits.save()
        result = tracer.result.save()
    assert list(result.prompt_token_ids) == hf_gpt2.ids(PROMPT)
    ref_outs, ref_logits = hf_gpt2(PROMPT)
    for i in range(n):
        assert isinstance(outs[i], torch.Tensor)  # GPT2Block returns the stream alone
        assert_close(outs[i], ref_outs[i])
    assert_close(logits[0], ref_logits)


def test_gpt2_edit_changes_logits(gpt2, hf_gpt2):
    with gpt2.trace(PROMPT, temperature=0.0, max_tokens=1):
        gpt2.transformer.h[1].output[:] = 0
        edited = gpt2.logits.save()
    _, ref_logits = hf_gpt2(PROMPT)
    assert rel_err(edited[0], ref_logits) > 0.01


# --- invokes and edits ------------------------------------------------------


def test_multi_invoke_saves_stay_apart(llama, hf_llama):
    with llama.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(SHORT):
            short_out = llama.model.layers[2].output.save()
            short_logits = llama.logits.save()
        with tracer.invoke(LONG):
            long_out = llama.model.layers[2].output.save()
            long_logits = llama.logits.save()
    assert short_out[0].shape == (len(SHORT), 128)
    assert long_out[0].shape == (len(LONG), 128)
    for prompt, out, logits in ((SHORT, short_out, short_logits), (LONG, long_out, long_logits)):
        ref_outs, ref_logits = hf_llama(prompt)
        assert_close(residual_stream(out), ref_outs[2])
        assert_close(logits[0], ref_logits)


def test_edit_changes_only_its_own_invoke(llama, hf_llama):
    with llama.trace(LONG, temperature=0.0, max_tokens=1):
        solo = llama.logits.save()

    with llama.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(SHORT):
            llama.model.layers[1].output[0][:] = 0
            llama.model.layers[1].output[1][:] = 0
            after = llama.model.layers[1].output.save()
            edited = llama.logits.save()
        with tracer.invoke(LONG):
            long_layer = llama.model.layers[1].output.save()
            untouched = llama.logits.save()

    assert after[0].abs().max() == 0 and after[1].abs().max() == 0
    _, ref_short = hf_llama(SHORT)
    assert rel_err(edited[0], ref_short) > 0.01
    # Same stream as HF with layer 1's output zeroed: layers 2.. see zeros.
    assert_close(untouched, solo)
    assert long_layer[0].abs().max() > 0
    _, ref_long = hf_llama(LONG)
    assert_close(untouched[0], ref_long)


def test_edit_matches_hf_with_the_same_edit(llama, hf_llama):
    """Zeroing layer 1's output in vLLM equals HF with layer 1's output zeroed."""
    with llama.trace(SHORT, temperature=0.0, max_tokens=1):
        llama.model.layers[1].output[0][:] = 0
        llama.model.layers[1].output[1][:] = 0
        edited = llama.logits.save()

    def zero(_module, _inputs, out):
        if isinstance(out, tuple):
            return (torch.zeros_like(out[0]),) + tuple(out[1:])
        return torch.zeros_like(out)

    hook = hf_llama.layers[1].register_forward_hook(zero)
    try:
        _, ref = hf_llama(SHORT)
    finally:
        hook.remove()
    assert_close(edited[0], ref)


# --- generation steps -------------------------------------------------------


def test_iter_logits_argmax_is_the_generated_tokens(llama):
    with llama.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        logits = list().save()
        for _ in tracer.iter[:3]:
            logits.append(llama.logits)
        result = tracer.result.save()
    generated = list(result.outputs[0].token_ids)
    assert len(generated) == 3 and len(logits) == 3
    assert [step.argmax(dim=-1).item() for step in logits] == generated


def test_a_name_the_block_binds_before_reading_does_not_ship_its_old_value(llama):
    """A cell run twice: the old ``logits`` is never what the block sees, so it is not sent (it cannot be here)."""
    import threading

    logits = threading.Lock()  # what nnsight would pickle and ship with the block: it cannot be pickled
    with llama.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        logits = list().save()
        for _ in tracer.iter[:3]:
            logits.append(llama.logits)
        result = tracer.result.save()
    assert [step.argmax(dim=-1).item() for step in logits] == list(result.outputs[0].token_ids)


def test_all_logits_argmax_is_the_generated_tokens(llama):
    plain = llama.generate(PROMPT, max_tokens=3, temperature=0.0)
    generated = list(plain[0].outputs[0].token_ids)
    with llama.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        logits = list().save()
        samples = list().save()
        for _ in tracer.all():
            logits.append(llama.logits)
            samples.append(llama.samples)
    assert len(logits) == 3
    assert [step.argmax(dim=-1).item() for step in logits] == generated
    assert [s.flatten().tolist() for s in samples] == [[t] for t in generated]


# --- registered edits -------------------------------------------------------


def test_registered_edit_rides_plain_generate_until_cleared(llama):
    prompts = [SHORT, LONG]
    with llama.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(SHORT):
            want_short = llama.model.layers[0].output[0].save()
        with tracer.invoke(LONG):
            want_long = llama.model.layers[0].output[0].save()

    with llama.edit() as (tracer, edit):
        h = llama.model.layers[0].output[0].save()
    try:
        outputs = llama.generate(prompts, max_tokens=2, temperature=0.0)
        assert len(outputs) == 2
        for output, want in zip(outputs, (want_short, want_long)):
            assert "h" in output.saves
            assert_close(output.saves["h"], want)
            assert len(output.outputs[0].token_ids) == 2
    finally:
        edit.clear()

    outputs = llama.generate(prompts, max_tokens=2, temperature=0.0)
    for output in outputs:
        assert "h" not in (getattr(output, "saves", None) or {})


# --- errors -----------------------------------------------------------------


def test_intervention_error_surfaces_and_engine_recovers(llama):
    with pytest.raises(ValueError, match="boom") as info:
        with llama.trace(PROMPT, temperature=0.0, max_tokens=1):
            hidden = llama.model.layers[1].output[0]
            if hidden.shape[0] > 0:
                raise ValueError("boom")
    # Still nnsight's contract too: a RuntimeError whose text starts with the type.
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, RequestError)
    assert str(info.value).startswith("ValueError: boom")
    assert "Intervention traceback" in str(info.value)

    with llama.trace(PROMPT, temperature=0.0, max_tokens=1):
        logits = llama.logits.save()
    assert logits.shape[-1] == llama.tokenizer.vocab_size or logits.shape[-1] == len(llama.tokenizer)


def test_index_error_surfaces_and_engine_recovers(llama):
    with pytest.raises(IndexError):
        with llama.trace(PROMPT, temperature=0.0, max_tokens=1):
            llama.model.layers[1].output[0][1000].save()

    with llama.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(SHORT):
            a = llama.logits.save()
        with tracer.invoke(LONG):
            b = llama.model.layers[3].output.save()
    assert a.shape[0] == 1 and b[0].shape[0] == len(LONG)


def test_error_in_one_invoke_is_raised(llama):
    with pytest.raises(RuntimeError, match="second"):
        with llama.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke(SHORT):
                llama.logits.save()
            with tracer.invoke(LONG):
                llama.model.layers[0].output[0]
                raise RuntimeError("second invoke failed")


def test_unknown_layer_index_is_a_clear_error(llama):
    # nnsight resolves `layers[99]` as attribute '99' of the ModuleList's envoy,
    # in the engine's worker: an AttributeError naming the missing index.
    with pytest.raises(AttributeError, match=r"has attribute '99'"):
        with llama.trace(PROMPT, temperature=0.0, max_tokens=1):
            llama.model.layers[99].output.save()


def test_unknown_module_is_a_clear_error(llama):
    with pytest.raises(AttributeError, match="nonexistent"):
        with llama.trace(PROMPT, temperature=0.0, max_tokens=1):
            llama.model.nonexistent.output.save()


# --- mode="async" -------------------------------------------------------------


def test_async_engine_streams_a_trace(model_dir, hf_llama):
    """``mode="async"``: a trace streams through ``tracer.backend``; saves land on the final output.

    Its own engine (AsyncLLM), used by one ``asyncio.run`` only: vLLM's output
    handler task belongs to the loop that first used the engine.
    """
    import asyncio

    from nnsight_ray.local import LocalVLLM

    amodel = LocalVLLM(model_dir, dispatch=True, dtype="float32", max_model_len=256, mode="async")

    async def counts():
        return await amodel.vllm_entrypoint.collective_rpc("nnsight_request_count")

    async def main():
        with amodel.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
            layer = amodel.model.layers[1].output.save()
            logits = amodel.logits.save()
        outputs = [output async for output in tracer.backend]
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        assert len(final.outputs[0].token_ids) == 3
        assert set(final.saves) >= {"layer", "logits"}
        ref_outs, ref_logits = hf_llama(PROMPT)
        assert_close(residual_stream(final.saves["layer"]), ref_outs[1])
        assert_close(final.saves["logits"][0], ref_logits)
        assert await counts() == [0]

        # A failing intervention surfaces with its type; the engine goes on.
        with amodel.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
            hidden = amodel.model.layers[0].output[0]
            if hidden.shape[0] > 0:
                raise ValueError("async boom")
        with pytest.raises(ValueError, match="async boom"):
            await tracer.backend
        assert await counts() == [0]

        # Plain generate is awaited on an async engine and agrees with the trace.
        plain = await amodel.generate(PROMPT, max_tokens=3, temperature=0.0)
        assert list(plain[0].outputs[0].token_ids) == list(final.outputs[0].token_ids)
        assert await counts() == [0]

    try:
        asyncio.run(main())
    finally:
        engine, amodel.vllm_entrypoint = amodel.vllm_entrypoint, None
        engine.shutdown()
        del engine  # collected now, not during interpreter teardown


def test_the_skip_tracer_gives_the_same_values_through_the_engine(llama):
    """``blocks.skip.SkipTracer`` (what ``trace`` uses on Python 3.12+; on 3.11 its classes run nnsight's own skip)
    composed with nnsight's vLLM tracer, against the tracer nnsight picks, on the same engine: equal values."""
    from nnsight_ray._internal.blocks.skip import SkipTracer

    a, b = multi_invoke(llama)
    sa, sb = multi_invoke(llama, tracer_cls=SkipTracer)
    assert torch.equal(a, sa) and torch.equal(b, sb)
