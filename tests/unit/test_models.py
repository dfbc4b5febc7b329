"""The tiny-checkpoint builder: deterministic, loadable by transformers, vLLM-shaped.

No engine and no Ray here: ``ray.init`` is made to raise for the whole module.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nnsight_ray.models import ARCHITECTURES, CHAT_TEMPLATE, build_model, ensure_model

# The test checkpoints; llama-1b (the GPU benchmark's 1.2B model, 2.4 GB) is built on the GPU host only.
TINY = sorted(arch for arch, spec in ARCHITECTURES.items() if spec.hidden_size <= 512)


def _weights(path: Path) -> bytes:
    return (path / "model.safetensors").read_bytes()


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One checkpoint per (arch, seed) this module needs, built once."""
    cache: dict = {}

    def get(arch: str, seed: int, copy: int = 0) -> Path:
        key = (arch, seed, copy)
        if key not in cache:
            cache[key] = build_model(tmp_path_factory.mktemp(f"{arch}-{seed}-{copy}"), arch=arch, seed=seed)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", TINY)
def test_same_seed_same_bytes(built, arch):
    a, b = built(arch, 0, copy=0), built(arch, 0, copy=1)
    assert a != b
    assert hashlib.sha256(_weights(a)).digest() == hashlib.sha256(_weights(b)).digest()
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].equal(tb[name]), name
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", TINY)
def test_different_seed_differs(built, arch):
    ta, tb = _tensors(built(arch, 0)), _tensors(built(arch, 1))
    assert ta.keys() == tb.keys()
    differing = [name for name in ta if ta[name].dim() >= 2 and not ta[name].equal(tb[name])]
    assert differing, "seed 1 produced the same weight matrices as seed 0"


@pytest.mark.parametrize("arch", TINY)
def test_loads_in_transformers_and_tokenizer_round_trips(built, arch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = built(arch, 0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)

    text = "Hello, world!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    # With special tokens too: the checkpoint's tokenizer adds none.
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text

    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tokenizer)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", TINY)
def test_head_dim_fits_cpu_attention(built, arch):
    from transformers import AutoConfig

    spec = ARCHITECTURES[arch]
    assert spec.head_dim >= 64
    config = AutoConfig.from_pretrained(built(arch, 0))
    assert config.hidden_size // config.num_attention_heads == spec.head_dim
    assert config.num_hidden_layers == spec.num_layers


def test_marker_and_ensure_model_reuse(built):
    path = built("llama", 0)
    assert json.loads((path / "nnsight_ray_model.json").read_text()) == {"arch": "llama", "seed": 0}
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(path, arch="llama", seed=0) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("arch", TINY)
def test_tokenizer_has_a_chat_template_in_its_vocabulary(built, arch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built(arch, 0))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi there"}],
                                         tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text


def test_ensure_model_rebuilds_a_checkpoint_without_the_chat_template(built, tmp_path):
    import shutil

    path = Path(shutil.copytree(built("llama", 0), tmp_path / "old"))
    for name in ("chat_template.jinja",):
        (path / name).unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ensure_model(path, arch="llama", seed=0)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(path).chat_template == CHAT_TEMPLATE


def test_unknown_arch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown arch 'mamba'.*gpt2.*llama"):
        build_model(tmp_path / "x", arch="mamba")
    assert not (tmp_path / "x").exists()
