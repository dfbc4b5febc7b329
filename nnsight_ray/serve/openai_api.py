"""OpenAI's surface beyond plain completions: chat, server-sent-event streams, models, errors.

The request and response shapes are vLLM's own pydantic models
(``vllm.entrypoints.openai``: ``ChatCompletionRequest`` and its
``to_sampling_params``, the response and stream-chunk models, ``ModelList``,
``ErrorResponse``), and a conversation becomes a prompt through vLLM's own
chat helpers (``parse_chat_messages``, ``safe_apply_chat_template``: the
checkpoint's chat template), so a request means here what it means to
``vllm serve``. vLLM's API server itself is not run: the replica's engine is a
``RayVLLM``, and what this module adds is nnsight's ``"nnsight"`` member
(named edits, saved values back) on every route.

Streams follow OpenAI's chunk format: ``data: <chunk JSON>`` events, the
first chunk of a chat choice carrying ``delta.role``, each later one the new
text, the last of a choice its ``finish_reason``; then (when
``stream_options.include_usage`` or saves were asked for) one chunk with
``choices: []`` carrying ``usage`` and the ``nnsight_saves`` /
``nnsight_errors`` fields; then ``data: [DONE]``. A failure mid-stream is one
``data: {"error": {...}}`` event before ``[DONE]``.

Pure logic: no Ray, no engine; ``deployment.py`` drives it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar

from pydantic import Field, model_validator
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from .protocol import NNsightOptions, finish_reason_of, gather_choices, nnsight_fields, refuse_streamed_n, usage

__all__ = ["ChatRequest", "SSE_DONE", "StreamChunks", "chat_prompt", "chat_response", "error_body",
           "models_list", "sse", "validation_message"]

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_body(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    """OpenAI's error object (vLLM's ``ErrorResponse``)."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump(mode="json")


def validation_message(error: Exception) -> str:
    """A request body's problems in one line: ``field: what is wrong; ...`` (pydantic's, condensed)."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return str(error)
    problems = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"])
        problems.append(f"{where}: {e['msg']}" if where else e["msg"])
    return "invalid request: " + "; ".join(problems)


class ChatRequest(ChatCompletionRequest):
    """vLLM's ``/v1/chat/completions`` body plus the ``"nnsight"`` member.

    What this server does not implement is refused, not ignored: tools,
    logprobs, beam search, ``echo``, and ``n > 1`` while streaming.
    """

    # vLLM caches a model's field names per class; a subclass needs its own.
    field_names: ClassVar[set[str] | None] = None

    nnsight: NNsightOptions = Field(default_factory=NNsightOptions)

    @model_validator(mode="after")
    def _supported(self) -> "ChatRequest":
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools / tool_choice are not supported by this server; leave them out")
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs is not supported by this server; leave it out")
        if self.use_beam_search:
            raise ValueError("use_beam_search is not supported by this server")
        if self.echo:
            raise ValueError("echo=true is not supported by this server; send echo=false")
        refuse_streamed_n(self.stream, self.n)
        return self


def chat_prompt(request: ChatRequest, model_config: Any, tokenizer: Any) -> tuple[dict[str, Any], Any]:
    """The engine request of a chat: ``({"prompt_token_ids": ...}, SamplingParams)``.

    The messages are rendered with the checkpoint's chat template (or the
    request's ``chat_template``) by vLLM's helpers; ``max_tokens`` defaults to
    what is left of the model's context, as under ``vllm serve``. Raises
    ``ValueError`` (a 400) for non-text content, a template that fails, or a
    prompt longer than the context.
    """
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import safe_apply_chat_template

    conversation, mm_data, _ = parse_chat_messages(request.messages, model_config, "string")
    if mm_data:
        raise ValueError("only text content is supported by this server (the message had "
                         f"{sorted(mm_data)} content)")
    token_ids = safe_apply_chat_template(
        model_config, tokenizer, conversation, chat_template=request.chat_template, tokenize=True,
        add_generation_prompt=request.add_generation_prompt, continue_final_message=request.continue_final_message,
        **(request.chat_template_kwargs or {}))
    max_tokens = get_max_tokens(model_config.max_model_len, request.max_completion_tokens or request.max_tokens,
                                len(token_ids), {})
    params = request.to_sampling_params(max_tokens, {})
    return {"prompt_token_ids": list(token_ids)}, request.nnsight.apply(params)


def chat_response(outputs: list[Any], model_name: str, return_saves: bool) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` object for finished ``RequestOutput``s (saves attached as for completions)."""
    from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponse,
                                                                  ChatCompletionResponseChoice, ChatMessage)

    choices, prompt_tokens = gather_choices(outputs)
    response = ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name,
        choices=[ChatCompletionResponseChoice(index=c.index, message=ChatMessage(role="assistant", content=c.text),
                                              finish_reason=c.finish_reason) for c in choices],
        usage=usage(prompt_tokens, sum(c.tokens for c in choices)), **nnsight_fields(choices, return_saves))
    return response.model_dump(mode="json", exclude_none=True)


class StreamChunks:
    """The chunks of one streamed response, ``kind`` ``"completion"`` or ``"chat"``; each a JSON-ready dict.

    One choice per prompt (streams take ``n = 1``), indexed as the prompts are.
    """

    def __init__(self, kind: str, model_name: str, choices: int) -> None:
        if kind not in ("completion", "chat"):
            raise ValueError(f"kind is 'completion' or 'chat', not {kind!r}")
        self.kind, self.model_name = kind, model_name
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_tokens = [0] * choices
        self.completion_tokens = [0] * choices

    def _chunk(self, choices: list[Any], **extra: Any) -> dict[str, Any]:
        if self.kind == "chat":
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse as Chunk
        else:
            from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse as Chunk
        chunk = Chunk(id=self.id, created=self.created, model=self.model_name, choices=choices, **extra)
        return chunk.model_dump(mode="json", exclude_none=True)

    def _choice(self, index: int, text: str | None, finish_reason: str | None, role: str | None = None) -> Any:
        if self.kind == "chat":
            from vllm.entrypoints.generate.base.protocol import DeltaMessage
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseStreamChoice

            return ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(role=role, content=text),
                                                      finish_reason=finish_reason)
        from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice

        return CompletionResponseStreamChoice(index=index, text=text or "", finish_reason=finish_reason)

    def start(self, index: int) -> dict[str, Any] | None:
        """A chat choice's first chunk (``delta.role = "assistant"``); completions have none."""
        if self.kind != "chat":
            return None
        return self._chunk([self._choice(index, "", None, role="assistant")])

    def step(self, index: int, output: Any) -> dict[str, Any] | None:
        """The chunk of one streamed ``RequestOutput`` (DELTA: its new text), or None if it says nothing."""
        self.prompt_tokens[index] = len(getattr(output, "prompt_token_ids", None) or ()) or self.prompt_tokens[index]
        completion = output.outputs[0] if output.outputs else None
        if completion is None:
            return None
        self.completion_tokens[index] += len(completion.token_ids)
        reason = finish_reason_of(completion) if output.finished else None
        if not completion.text and reason is None:
            return None
        return self._chunk([self._choice(index, completion.text, reason)])

    def final(self, include_usage: bool, finished: list[Any] | None) -> dict[str, Any] | None:
        """The closing chunk (``choices: []``): ``usage`` if asked, saves if ``finished`` (outputs with saves) given."""
        extra: dict[str, Any] = {}
        if include_usage:
            extra["usage"] = usage(sum(self.prompt_tokens), sum(self.completion_tokens))
        if finished is not None:
            extra.update(nnsight_fields(gather_choices(finished)[0], True))
        return self._chunk([], **extra) if extra else None


def models_list(model_id: str, max_model_len: int | None) -> dict[str, Any]:
    """``/v1/models``: the one model this application serves (vLLM's ``ModelList``)."""
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

    card = ModelCard(id=model_id, root=model_id, owned_by="nnsight_ray", max_model_len=max_model_len)
    return ModelList(data=[card]).model_dump(mode="json", exclude_none=True)
