"""What crosses the wire: nnsight-serve's trace payloads and OpenAI-style completions.

Traces. A client's ``model.trace(..., serve=url)`` posts
``RequestModel.serialize(tracer)`` bytes; the reply is a ``torch.save`` of
``{"saves": {name: value}, "error": <deferred error or None>}``. The trace is
rebuilt here exactly as nnsight's own server does it (``server._build_tracer``
and its ``generate``): deserialize against the replica's meta model, run the
block to build the invoke workers, serialize them onto the requests'
``SamplingParams``, and cancel the interleaver. That whole build runs without
an ``await``: the meta model has one interleaver, and ``deserialize`` writes
the client's source into the process-wide ``linecache`` under the client's
file name, so two builds must never interleave.

Completions. ``POST /v1/completions`` takes OpenAI's request body (prompt,
max_tokens, temperature, ...) and answers with OpenAI's ``text_completion``
shape. Requests built here carry no nnsight block, but every registered block
runs on them; what those blocks saved comes back, when asked for, in the
non-standard ``nnsight_saves`` field (see :func:`encode_saves`).
"""

from __future__ import annotations

import ast
import base64
import io
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["BuiltTrace", "CompletionRequest", "build_trace", "completion_response", "decode_saves",
           "encode_saves", "trace_payload"]

RETURN_SAVES_HEADER = "nnsight-return-saves"


# --------------------------------------------------------------------------- traces


@dataclass
class BuiltTrace:
    """A deserialized trace, ready to submit: one request per invoke."""

    prompts: list[Any]
    params: list[Any]
    loras: list[Any] | None
    presaved: set[str]


def build_trace(model: Any, body: bytes, persistent_objects: dict, compress: bool = False) -> BuiltTrace:
    """Rebuild a serialized trace against ``model`` (a meta-only nnsight ``VLLM``).

    Synchronous by design, see the module docstring; raises whatever the
    deserialize or the block raised (the caller reports it as the trace's
    deferred error).
    """
    import linecache

    from nnsight.intervention.util import clear_shared_locals
    from nnsight.schema.request import RequestModel

    try:
        tracer = RequestModel.deserialize(body, persistent_objects, compress=compress)
        # deserialize drops the AST node, which re-serializing the workers onto
        # the requests needs; parse the shipped source back (nnsight's server does
        # the same in _build_tracer).
        source = "".join(linecache.cache[tracer.info.frame.f_code.co_filename][2])
        tracer.node = ast.parse(source)
        _, (prompts, params, loras), forward_kwargs = tracer.prepare(tracer.info.code)
        mediators = model._attach_mediators(params, **forward_kwargs)
        presaved: set[str] = set()
        for mediator in mediators:
            presaved |= set(getattr(mediator, "presaved", ()) or ())
        return BuiltTrace(list(prompts), list(params), list(loras) if loras else None, presaved)
    finally:
        # Whether or not the build succeeded: its workers are serialized onto the
        # requests now (or never will be), and must not bleed into the next build.
        model.interleaver.cancel()
        clear_shared_locals()


def trace_payload(saves: dict[str, Any], error: dict | None) -> bytes:
    """The body of a ``/v1/nnsight/generate`` reply."""
    import torch

    buffer = io.BytesIO()
    torch.save({"saves": saves, "error": error}, buffer)
    return buffer.getvalue()


# --------------------------------------------------------------------------- completions


class NNsightOptions(BaseModel):
    """The non-standard ``"nnsight"`` member of a completions request."""

    model_config = ConfigDict(extra="forbid")

    return_saves: bool = Field(False, description="Return what registered blocks saved, as nnsight_saves.")
    edits: list[str] | None = Field(
        None, description="Names of installed edits to run (plus every unnamed one); default: all."
    )


class CompletionRequest(BaseModel):
    """OpenAI's ``/v1/completions`` body, the fields this server honours.

    Fields that would change what comes back in ways not implemented here
    (streaming, echo, logprobs, best_of) are refused rather than ignored;
    informational ones (``user``, ``model``) are accepted.
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | list[str | list[int]]
    max_tokens: int | None = Field(16, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    user: str | None = None
    nnsight: NNsightOptions = Field(default_factory=NNsightOptions)

    @field_validator("stream", "echo")
    @classmethod
    def _off(cls, value: bool, info: Any) -> bool:
        if value:
            raise ValueError(f"{info.field_name}=true is not supported by this server; send {info.field_name}=false")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("logprobs is not supported by this server; leave it out")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("best_of is not supported; use n")
        return value

    def prompts(self) -> list[Any]:
        """vLLM prompts: text, or ``{"prompt_token_ids": [...]}`` for token lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        if isinstance(prompt[0], int):
            return [{"prompt_token_ids": list(prompt)}]
        return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]

    def sampling_params(self) -> Any:
        from vllm import SamplingParams

        fields: dict[str, Any] = {"n": self.n}
        for name in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        params = SamplingParams(**fields)
        if self.nnsight.edits is not None:
            # Where nnsight's _attach_mediators puts a trace's `edits=`: the worker
            # runs the listed named edits and every unnamed one.
            params.extra_args = {**(params.extra_args or {}), "nnsight_edits": list(self.nnsight.edits)}
        return params


def encode_saves(per_choice: list[dict[str, Any]]) -> str:
    """``nnsight_saves``: base64 of ``torch.save`` of one ``{name: value}`` per choice."""
    import torch

    buffer = io.BytesIO()
    torch.save(per_choice, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_saves(field: str) -> list[dict[str, Any]]:
    """The inverse of :func:`encode_saves`, for clients (unpickles: trust the server)."""
    import torch

    return torch.load(io.BytesIO(base64.b64decode(field)), map_location="cpu", weights_only=False)


def _finish_reason(completion: Any) -> str | None:
    reason = getattr(completion, "finish_reason", None)
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(reason, reason)


def completion_response(outputs: list[Any], model_name: str, return_saves: bool) -> dict[str, Any]:
    """OpenAI's ``text_completion`` object for vLLM ``RequestOutput``s (saves attached).

    Choices are ordered prompt by prompt, then sequence by sequence (``n``),
    as OpenAI orders them. With ``return_saves``, ``nnsight_saves[i]`` is what
    the registered blocks saved for choice ``i`` (a sequence's own values when
    ``n > 1``), and ``nnsight_errors[i]`` the error one of them raised, if any.
    """
    choices, saves, errors = [], [], []
    prompt_tokens = completion_tokens = 0
    for output in outputs:
        prompt_tokens += len(getattr(output, "prompt_token_ids", None) or ())
        error = getattr(output, "nnsight_error", None)
        for completion in output.outputs:
            completion_tokens += len(completion.token_ids)
            choices.append({"index": len(choices), "text": completion.text, "logprobs": None,
                            "finish_reason": _finish_reason(completion)})
            own = getattr(completion, "saves", None)
            saves.append(dict(own if own is not None else getattr(output, "saves", {}) or {}))
            errors.append(None if not error or error.get("is_control_flow")
                          else f"{error.get('type_name')}: {error.get('message')}")
    response: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    if return_saves:
        response["nnsight_saves"] = encode_saves(saves)
        response["nnsight_errors"] = errors
    return response
