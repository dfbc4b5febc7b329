"""How a call's prompts become vLLM's engine inputs: in batches of about one step, tokenized together.

``EngineCore._start_rendered`` renders a call's prompts with ``render_batch`` in
the batches ``render_batches`` gives, adding each batch as soon as it renders.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# Characters of prompt text per render batch (``EngineCore._start_rendered``); 0: about one engine step's worth.
RENDER_BATCH_CHARS = int(os.environ.get("NNSIGHT_RAY_RENDER_BATCH_CHARS", "0"))


# A call longer than one step starts with a batch of 1/RENDER_RAMP of a step, each next one twice as large.
RENDER_RAMP = 8


def _chars(prompt: Any) -> int:
    """A prompt's size in characters: its text, or 4 a token for token ids, or its ``str``."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
        return 4 * len(prompt["prompt_token_ids"])
    return len(str(prompt))


def render_batches(prompts: list, chars: int) -> list[range]:
    """Consecutive runs of ``prompts`` (each at least one prompt): the batches a call renders in.

    A call of at most ``chars`` characters (about one engine step) is one batch,
    so its requests start in the same step. A longer call ramps up: its first
    batch is about ``chars / RENDER_RAMP``, each next one twice the last, up
    to ``chars``, so the GPU starts on the first prompts while the rest are
    tokenized (on the H200 a first batch of a whole step kept it idle ~80 ms;
    benchmarks/results/HISTORY.md).
    """
    sizes = [_chars(prompt) for prompt in prompts]
    limit = chars if sum(sizes) <= chars else max(chars // RENDER_RAMP, 1)
    batches, start, size = [], 0, 0
    for index, grown in enumerate(sizes):
        size += grown
        if size >= limit:
            batches.append(range(start, index + 1))
            start, size, limit = index + 1, 0, min(2 * limit, chars)
    if start < len(prompts):
        batches.append(range(start, len(prompts)))
    return batches


def render_batch(renderer: Any, parsed: list) -> list:
    """vLLM's ``renderer.render_cmpl(parsed)`` with its defaults, its plain text prompts tokenized in one call.

    ``render_cmpl`` tokenizes one prompt per tokenizer call; a fast tokenizer's
    call is a trip into Rust and its thread pool, and on the H200 host that was
    38% of the engine actor's samples in a 2,048-prompt prefill (benchmarks/results/HISTORY.md).
    Here every prompt that is text alone (no multimodal data, no
    other keys, no token offsets wanted) goes through the renderer's own steps
    for text: ``apply_pre_tokenization`` (length check, lower-casing), the same
    tokenizer with the same ``get_encode_kwargs``, given the whole list at once,
    and ``_build_tokens_prompt``; ``render_cmpl`` then finds token ids and
    applies the rest as it always does (``apply_post_tokenization``: token
    truncation and checks; the engine input). Anything else is left to it, and
    so is the whole batch if the one call fails (a too-long prompt then fails
    ``render_cmpl`` as it would alone, and the batch renders request by request,
    ``EngineCore._start_rendered``, as any refused prompt does).
    """
    params = renderer.default_cmpl_tok_params
    try:
        tokenized = _tokenized_together(renderer, parsed, params)
    except Exception:  # noqa: BLE001 - vLLM's own path below says what is wrong, prompt by prompt
        logger.debug("tokenizing %d prompts in one call failed; vLLM's renderer tokenizes them", len(parsed),
                     exc_info=True)
        tokenized = parsed
    return renderer.render_cmpl(tokenized, params)


def _tokenized_together(renderer: Any, parsed: list, params: Any) -> list:
    """``parsed`` with its plain text prompts as token prompts, tokenized in one call (``render_batch``).

    Only a Hugging Face tokenizer (what ``render_cmpl`` calls with one string)
    is given the list; any other kind of tokenizer leaves ``parsed`` as it is.
    """
    from transformers import PreTrainedTokenizerBase

    texts = [i for i, p in enumerate(parsed) if isinstance(p, dict) and set(p) == {"prompt"}
             and isinstance(p["prompt"], str)]
    if not texts or getattr(params, "return_token_offsets", False) or not hasattr(renderer, "get_tokenizer"):
        return parsed
    tokenizer = renderer.get_tokenizer()
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        return parsed
    ready = [params.apply_pre_tokenization(renderer.tokenizer, dict(parsed[i])) for i in texts]
    ids = tokenizer([p["prompt"] for p in ready], **params.get_encode_kwargs())["input_ids"]
    tokenized = list(parsed)
    for i, prompt, token_ids in zip(texts, ready, ids):
        tokenized[i] = renderer._build_tokens_prompt(token_ids, prompt)
    return tokenized
