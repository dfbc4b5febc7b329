"""Tiny, deterministic checkpoints to test and demo with, built by the project.

No model can be downloaded on the machines this project is developed and tested
on, so the project writes its own: a randomly initialised (seeded) HuggingFace
checkpoint plus a character-level tokenizer, saved with ``save_pretrained`` so
vLLM, nnsight and transformers all load the same folder.

Two architectures give two module trees: ``llama`` (``model.layers[i]``, decoder
layers returning ``(hidden, residual)`` in vLLM) and ``gpt2``
(``transformer.h[i]``, returning the hidden state alone). Both keep
``head_dim = 64``: vLLM's CPU attention kernels refuse smaller heads. ``gpt2-12``
(``SUITE_ARCHITECTURES``) is GPT-2 small's tree and 50257-id vocabulary at
hidden 128, for nnsight's own vLLM test file (``python -m benchmarks.nnsight_suite``).

Usage::

    python -m nnsight_ray.models /tmp/tiny-llama --arch llama
    nnsight-ray build-model /tmp/tiny-gpt2 --arch gpt2
"""

from __future__ import annotations

import argparse
import json
import os
import string
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ARCHITECTURES", "CHAT_TEMPLATE", "ModelSpec", "SUITE_ARCHITECTURES", "build_model", "ensure_model"]

# Characters the tokenizer knows; everything else maps to <unk>.
_CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
_SPECIALS = ["<unk>", "<s>", "</s>"]
#: The chat template of every tiny checkpoint (``/v1/chat/completions``, ``tokenizer.apply_chat_template``):
#: each message as ``<|role|>``, newline, content, newline; then ``<|assistant|>`` and a newline to answer.
#: Every character is in the tokenizer's vocabulary.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """The shape of one tiny checkpoint."""

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int = 512
    #: Padded past the tokenizer's ids (the extra rows are never sampled by a greedy run of a trained model,
    #: but a random one may sample them: they decode to nothing). None: the tokenizer's size.
    vocab_size: int | None = None
    init_std: float = 0.08
    #: The dtype the checkpoint is written in.
    dtype: str = "float32"
    #: ``chars``: one token per character (~100 ids); ``gpt2-bytes``: GPT-2's byte-level scheme with
    #: its 50257 ids (``<|endoftext|>`` = 50256), see :func:`_build_gpt2_tokenizer`.
    tokenizer: str = "chars"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


ARCHITECTURES: dict[str, ModelSpec] = {
    # 4 layers so PP=2 puts two on each stage; 2 heads of 64 so TP=2 gives each
    # rank one head.
    "llama": ModelSpec("llama", hidden_size=128, num_layers=4, num_heads=2, num_kv_heads=2, intermediate_size=256),
    "gpt2": ModelSpec("gpt2", hidden_size=128, num_layers=4, num_heads=2, num_kv_heads=2, intermediate_size=512),
    # The GPU benchmark's model (python -m benchmarks.gpu): a random 1.2B Llama, written in bf16 (2.4 GB).
    "llama-1b": ModelSpec("llama", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8,
                          intermediate_size=5632, max_positions=2048, vocab_size=32000, init_std=0.02,
                          dtype="bfloat16"),
}

#: Checkpoints for foreign test suites, outside ``ARCHITECTURES`` (whose tiny entries promise one token per
#: character); ``build_model`` and the CLI take both. ``gpt2-12``: GPT-2 small's module tree and vocabulary
#: (12 layers, c_fc width 3072, 50257 ids) at hidden 128, what nnsight's own tests/test_vllm.py indexes and
#: asserts (python -m benchmarks.nnsight_suite); 66 MB, ~40 s to build.
SUITE_ARCHITECTURES: dict[str, ModelSpec] = {
    "gpt2-12": ModelSpec("gpt2", hidden_size=128, num_layers=12, num_heads=2, num_kv_heads=2,
                         intermediate_size=3072, max_positions=1024, vocab_size=50257, tokenizer="gpt2-bytes"),
}
_ALL_ARCHITECTURES = {**ARCHITECTURES, **SUITE_ARCHITECTURES}

#: Whole GPT-2 tokens the ``gpt2-bytes`` tokenizer knows (merges spell each one out); every other word
#: is split into bytes. nnsight's suite prompts tokenize as GPT-2 does ("The Eiffel Tower is located in
#: the city of": 11 tokens).
_GPT2_WORDS = ["The", "\u0120E", "iff", "el", "\u0120Tower", "\u0120is", "\u0120located", "\u0120in",
               "\u0120the", "\u0120city", "\u0120of", "Mad", "ison", "\u0120Square", "\u0120Garden",
               "\u0120Paris", "\u0120London", "\u0120New", "\u0120York", "\u0120City"]
_GPT2_VOCAB = 50257


def _build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(_SPECIALS + list(_CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # One token per character, spaces included.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte, in id order 0..255 (its ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _build_gpt2_tokenizer():
    """A byte-level BPE tokenizer with GPT-2's 50257 ids: the 256 bytes, merges spelling out
    :data:`_GPT2_WORDS`, filler tokens ``<|t<i>|>`` (decodable, never produced by encoding) and
    ``<|endoftext|>`` last, as GPT-2 has it (bos = eos, no pad token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    merges = []
    for word in _GPT2_WORDS:
        prefix = word[0]
        for ch in word[1:]:
            if prefix + ch not in vocab:
                merges.append((prefix, ch))
                vocab[prefix + ch] = len(vocab)
            prefix += ch
    while len(vocab) < _GPT2_VOCAB - 1:
        vocab[f"<|t{len(vocab)}|>"] = len(vocab)
    vocab["<|endoftext|>"] = _GPT2_VOCAB - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>", clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _config(spec: ModelSpec, vocab_size: int, tokenizer):
    common = dict(vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if spec.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_positions,
            tie_word_embeddings=False,
            dtype=spec.dtype,
            **common,
        )
    if spec.arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            n_embd=spec.hidden_size,
            n_layer=spec.num_layers,
            n_head=spec.num_heads,
            n_inner=spec.intermediate_size,
            n_positions=spec.max_positions,
            dtype="float32",
            **common,
        )
    raise ValueError(f"unknown arch {spec.arch!r}; choose one of {sorted(ARCHITECTURES)}")


def build_model(path: str | os.PathLike, arch: str = "llama", seed: int = 0) -> Path:
    """Write a seeded tiny checkpoint of ``arch`` and its tokenizer to ``path``.

    The same ``(arch, seed)`` always gives the same weights, so tests and
    references computed in different processes agree.
    """
    if arch not in _ALL_ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(_ALL_ARCHITECTURES)}")
    import torch
    from transformers import AutoModelForCausalLM

    spec = _ALL_ARCHITECTURES[arch]
    tokenizer = _build_gpt2_tokenizer() if spec.tokenizer == "gpt2-bytes" else _build_tokenizer()
    config = _config(spec, spec.vocab_size or len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    # A large model is built on the GPU when there is one (seconds instead of minutes).
    device = "cuda" if spec.hidden_size >= 1024 and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    # Larger-than-default init so layers visibly change the residual stream.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, spec.init_std)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "nnsight_ray_model.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return path


def ensure_model(path: str | os.PathLike, arch: str = "llama", seed: int = 0) -> Path:
    """Build the checkpoint unless ``path`` already holds the same one (with today's chat template)."""
    path = Path(path)
    marker = path / "nnsight_ray_model.json"
    if marker.exists() and json.loads(marker.read_text()) == {"arch": arch, "seed": seed} and _has_chat_template(path):
        return path
    return build_model(path, arch=arch, seed=seed)


def _has_chat_template(path: Path) -> bool:
    """Whether the checkpoint's tokenizer carries :data:`CHAT_TEMPLATE` (older builds had none)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path).chat_template == CHAT_TEMPLATE
    except Exception:
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nnsight-ray build-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="folder to write the checkpoint to")
    parser.add_argument("--arch", default="llama", choices=sorted(_ALL_ARCHITECTURES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_model(args.path, arch=args.arch, seed=args.seed))


if __name__ == "__main__":
    main()
