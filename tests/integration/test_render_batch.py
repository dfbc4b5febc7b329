"""A call's prompts tokenized in one tokenizer call render exactly as vLLM's renderer renders them alone.

``render.render_batch`` hands vLLM's real renderer (built from the engine's
config, as ``AsyncLLM`` builds it) token prompts it tokenized in one batch;
what comes out must equal ``render_cmpl`` on the raw prompts, for the project's
character tokenizer and a byte-level BPE (GPT-2's ids), with and without
special tokens, empty, non-ASCII, mixed with token prompts; a prompt too long
for the model fails in both.
"""

from __future__ import annotations

import json
import shutil

import pytest

from nnsight_ray._internal.engine.render import render_batch
from nnsight_ray.models import _build_gpt2_tokenizer

PROMPTS = ["Hello world", "", "héllo wörld — 東京", "the quick brown fox " * 10, "<|endoftext|> and <s> as text",
           {"prompt_token_ids": [5, 6, 7]}, "  leading and trailing spaces  ", "new\nlines\tand tabs"]


@pytest.fixture(scope="module", params=["chars", "gpt2-bytes"])
def renderer(request, model_dir, tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    path = model_dir
    if request.param == "gpt2-bytes":  # the same model, GPT-2's byte-level BPE as its tokenizer
        path = tmp_path_factory.mktemp("gpt2-tok")
        shutil.copy(f"{model_dir}/config.json", path / "config.json")
        config = json.loads((path / "config.json").read_text())
        config.update(vocab_size=50257, bos_token_id=50256, eos_token_id=50256)
        (path / "config.json").write_text(json.dumps(config))
        _build_gpt2_tokenizer().save_pretrained(path)
    config = EngineArgs(model=str(path), max_model_len=256, enforce_eager=True).create_engine_config()
    return renderer_from_config(config), config.model_config


def _parsed(model_config, prompts):
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    return [parse_model_prompt(model_config, p) for p in prompts]


def _without_time(inputs):
    return [{k: v for k, v in dict(i).items() if k != "arrival_time"} for i in inputs]


def test_batch_renders_what_vllm_renders_one_by_one(renderer):
    renderer, model_config = renderer
    one_by_one = renderer.render_cmpl(_parsed(model_config, PROMPTS), renderer.default_cmpl_tok_params)
    calls = []
    tokenizer = renderer.get_tokenizer()

    class Counting(type(tokenizer)):  # the renderer's tokenizer, counting how it is called
        def __call__(self, text, **kwargs):
            calls.append(text)
            return tokenizer(text, **kwargs)

    real = renderer.get_tokenizer
    renderer.get_tokenizer = lambda: Counting.__new__(Counting)
    try:
        batched = render_batch(renderer, _parsed(model_config, PROMPTS))
    finally:
        renderer.get_tokenizer = real
    assert _without_time(batched) == _without_time(one_by_one)
    texts = [p for p in PROMPTS if isinstance(p, str)]
    assert calls == [texts]  # every text prompt in one call, the token prompt in none


def test_a_prompt_too_long_fails_in_both(renderer):
    renderer, model_config = renderer
    prompts = ["ok", "x " * 4000]
    with pytest.raises(Exception) as vllm_says:
        renderer.render_cmpl(_parsed(model_config, prompts), renderer.default_cmpl_tok_params)
    with pytest.raises(type(vllm_says.value)) as ours:
        render_batch(renderer, _parsed(model_config, prompts))
    assert str(ours.value) == str(vllm_says.value)


def test_a_tokenizer_that_is_not_hugging_faces_is_left_to_vllm(renderer, monkeypatch):
    import transformers

    renderer, model_config = renderer
    calls = []
    tokenizer = renderer.get_tokenizer()

    class Counting(type(tokenizer)):
        def __call__(self, text, **kwargs):
            calls.append(text)
            return tokenizer(text, **kwargs)

    class Other:  # the class render_batch asks for: this tokenizer is not one
        pass

    monkeypatch.setattr(transformers, "PreTrainedTokenizerBase", Other)
    monkeypatch.setattr(renderer, "get_tokenizer", lambda: Counting.__new__(Counting))
    batched = render_batch(renderer, _parsed(model_config, PROMPTS[:3]))
    assert calls == PROMPTS[:3]  # vLLM's renderer, one call per prompt
    monkeypatch.undo()
    one_by_one = renderer.render_cmpl(_parsed(model_config, PROMPTS[:3]), renderer.default_cmpl_tok_params)
    assert _without_time(batched) == _without_time(one_by_one)
