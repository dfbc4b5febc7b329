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
max_tokens, temperature, stream, ...) and answers with OpenAI's
``text_completion`` shape (chat, streams and models: ``openai_api.py``).
Requests built here carry no nnsight block, but every registered block runs
on them; what those blocks saved comes back, when asked for, in the
non-standard ``nnsight_saves`` field: base64 safetensors, language neutral
(see :func:`encode_saves`).
"""

from __future__ import annotations

import ast
import base64
import io
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..refs import BuiltTrace, build

__all__ = ["BuiltTrace", "CompletionRequest", "build_trace", "completion_response", "decode_saves",
           "encode_saves", "trace_payload"]

RETURN_SAVES_HEADER = "nnsight-return-saves"


# --------------------------------------------------------------------------- traces


def build_trace(model: Any, body: bytes, persistent_objects: dict, compress: bool = False) -> BuiltTrace:
    """Rebuild a serialized trace against ``model`` (a meta-only nnsight ``VLLM``).

    Synchronous by design, see the module docstring; raises whatever the
    deserialize or the block raised (the caller reports it as the trace's
    deferred error). A payload that is not one trace (a ``model.session()``
    block) is refused with a ``TypeError`` before any of it runs.
    """
    import linecache

    from nnsight.intervention.util import clear_shared_locals
    from nnsight.modeling.vllm.tracer import VLLMTracer
    from nnsight.schema.request import RequestModel

    try:
        tracer = RequestModel.deserialize(body, persistent_objects, compress=compress)
        if not isinstance(tracer, VLLMTracer):
            raise TypeError(f"this server runs one model.trace(...) per request; got a {type(tracer).__name__} "
                            "(model.session(...) is not supported: send each trace of the session on its own)")
    except BaseException:
        # Nothing may bleed into the next build, even from a half-read trace.
        model.interleaver.cancel()
        clear_shared_locals()
        raise
    # deserialize drops the AST node, which re-serializing the workers onto
    # the requests needs; parse the shipped source back (nnsight's server does
    # the same in _build_tracer).
    source = "".join(linecache.cache[tracer.info.frame.f_code.co_filename][2])
    tracer.node = ast.parse(source)
    return build(model, tracer)


def trace_payload(saves: dict[str, Any], error: dict | None) -> bytes:
    """The body of a ``/v1/nnsight/generate`` reply."""
    import torch

    buffer = io.BytesIO()
    torch.save({"saves": saves, "error": error}, buffer)
    return buffer.getvalue()


# --------------------------------------------------------------------------- completions


class NNsightOptions(BaseModel):
    """The non-standard ``"nnsight"`` member of an OpenAI request (completions, chat)."""

    model_config = ConfigDict(extra="forbid")

    return_saves: bool = Field(False, description="Return what registered blocks saved, as nnsight_saves.")
    edits: list[str] | None = Field(
        None, description="Names of registered edits to run (plus every unnamed one); default: all. "
        "Naming one implies return_saves."
    )

    @property
    def wants_saves(self) -> bool:
        """Whether the reply carries ``nnsight_saves``: asked for, or edits named (why else name them)."""
        return self.return_saves or self.edits is not None

    def apply(self, params: Any) -> Any:
        """Put the named edits on a request's ``SamplingParams`` (where nnsight's ``_attach_mediators``
        puts a trace's ``edits=``: the worker runs those and every unnamed one)."""
        if self.edits is not None:
            params.extra_args = {**(params.extra_args or {}), "nnsight_edits": list(self.edits)}
        return params


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


def refuse_streamed_n(stream: bool | None, n: int | None) -> None:
    if stream and (n or 1) > 1:
        raise ValueError("n > 1 with stream=true is not supported by this server; stream with n=1, "
                         "or send stream=false")


class CompletionRequest(BaseModel):
    """OpenAI's ``/v1/completions`` body, the fields this server honours.

    Fields that would change what comes back in ways not implemented here
    (echo, logprobs, best_of, n > 1 when streaming) are refused rather than
    ignored; informational ones (``user``, ``model``) are accepted.
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
    ignore_eos: bool | None = None  # vLLM's extension, as vllm serve takes it
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    user: str | None = None
    nnsight: NNsightOptions = Field(default_factory=NNsightOptions)

    @field_validator("echo")
    @classmethod
    def _off(cls, value: bool, info: Any) -> bool:
        if value:
            raise ValueError(f"{info.field_name}=true is not supported by this server; send {info.field_name}=false")
        return value

    @model_validator(mode="after")
    def _streamed_n(self) -> "CompletionRequest":
        refuse_streamed_n(self.stream, self.n)
        return self

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
        for name in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                     "ignore_eos"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stream:
            from vllm.sampling_params import RequestOutputKind

            fields["output_kind"] = RequestOutputKind.DELTA  # each step's new text only
        return self.nnsight.apply(SamplingParams(**fields))


SAVES_FORMAT = "nnsight-saves/1"


def _encode_value(value: Any, key: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """One saved value as a JSON node; its tensors go into ``tensors`` under path-like keys."""
    import torch

    if isinstance(value, torch.Tensor):
        while key in tensors:
            key += "#"
        # Own, contiguous CPU storage: safetensors refuses views that share memory.
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"json": value}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode_value(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode_value(v, f"{key}/{k}", tensors) for k, v in value.items()}}
    return {"unsupported": type(value).__name__, "repr": repr(value)[:200]}


def encode_saves(per_choice: list[dict[str, Any]]) -> str:
    """``nnsight_saves``: base64 of a safetensors file holding one ``{name: value}`` per choice.

    Language neutral (docs/serve.md, "Saved values"): the file's tensors are
    every saved tensor, keyed ``"<choice>/<name>"`` (nested ones
    ``"<choice>/<name>/<index or key>"``); its ``__metadata__`` holds
    ``format`` (``nnsight-saves/1``) and ``saves``, a JSON list with one
    ``{name: node}`` per choice, where a node is ``{"tensor": key}``,
    ``{"json": scalar}``, ``{"list": [node]}``, ``{"tuple": [node]}``,
    ``{"dict": {key: node}}`` or, for a value of another type,
    ``{"unsupported": type name, "repr": text}``.
    """
    import json

    from safetensors.torch import save

    tensors: dict[str, Any] = {}
    tree = [{name: _encode_value(value, f"{index}/{name}", tensors) for name, value in saves.items()}
            for index, saves in enumerate(per_choice)]
    blob = save(tensors, metadata={"format": SAVES_FORMAT, "saves": json.dumps(tree)})
    return base64.b64encode(blob).decode("ascii")


def _decode_value(node: dict[str, Any], tensors: dict[str, Any]) -> Any:
    if len(node) != 1:
        return dict(node)  # {"unsupported": type name, "repr": text}: what could not be encoded
    kind, value = next(iter(node.items()))
    if kind == "tensor":
        return tensors[value]
    if kind == "json":
        return value
    if kind in ("list", "tuple"):
        items = [_decode_value(v, tensors) for v in value]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _decode_value(v, tensors) for k, v in value.items()}
    raise ValueError(f"nnsight_saves: unknown node kind {kind!r}")


def decode_saves(field: str) -> list[dict[str, Any]]:
    """The inverse of :func:`encode_saves`: one ``{name: value}`` per choice, tensors on the CPU.

    Reads no pickle: safe on a reply from any server. A value the server
    could not encode comes back as ``{"unsupported": type name, "repr": text}``.
    """
    import json
    import struct

    from safetensors.torch import load

    blob = base64.b64decode(field)
    (header_size,) = struct.unpack("<Q", blob[:8])
    metadata = json.loads(blob[8:8 + header_size]).get("__metadata__") or {}
    if metadata.get("format") != SAVES_FORMAT:
        raise ValueError(f"nnsight_saves is not {SAVES_FORMAT} (format {metadata.get('format')!r})")
    tensors = load(blob)
    return [{name: _decode_value(node, tensors) for name, node in saves.items()}
            for saves in json.loads(metadata["saves"])]


def finish_reason_of(completion: Any) -> str | None:
    reason = getattr(completion, "finish_reason", None)
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(reason, reason)


@dataclass
class Choice:
    """One OpenAI choice of a finished request: its text, and what the registered blocks made of it."""

    index: int
    text: str
    finish_reason: str | None
    tokens: int
    saves: dict[str, Any]
    #: ``"Type: message"`` of the error a block raised on this choice's request, or None.
    error: str | None = None
    error_type: str | None = None


def error_of(output: Any) -> tuple[str | None, str | None]:
    """``("Type: message", "Type")`` of the intervention error on a ``RequestOutput``, or ``(None, None)``."""
    error = getattr(output, "nnsight_error", None)
    if not error or error.get("is_control_flow"):
        return None, None
    return f"{error.get('type_name')}: {error.get('message')}", str(error.get("type_name"))


def gather_choices(outputs: list[Any]) -> tuple[list[Choice], int]:
    """The choices of finished ``RequestOutput``s and their prompt tokens.

    Choices are ordered prompt by prompt, then sequence by sequence (``n``),
    as OpenAI orders them; a choice's saves are its sequence's own values when
    ``n > 1``, else its request's.
    """
    choices: list[Choice] = []
    prompt_tokens = 0
    for output in outputs:
        prompt_tokens += len(getattr(output, "prompt_token_ids", None) or ())
        message, kind = error_of(output)
        for completion in output.outputs:
            own = getattr(completion, "saves", None)
            choices.append(Choice(len(choices), completion.text, finish_reason_of(completion), len(completion.token_ids),
                                  dict(own if own is not None else getattr(output, "saves", {}) or {}),
                                  message, kind))
    return choices, prompt_tokens


def nnsight_fields(choices: list[Choice], return_saves: bool) -> dict[str, Any]:
    """``nnsight_saves`` and ``nnsight_errors`` (one entry per choice), when the client asked for them."""
    if not return_saves:
        return {}
    return {"nnsight_saves": encode_saves([c.saves for c in choices]), "nnsight_errors": [c.error for c in choices]}


def usage(prompt_tokens: int, completion_tokens: int) -> Any:
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def completion_response(outputs: list[Any], model_name: str, return_saves: bool) -> dict[str, Any]:
    """OpenAI's ``text_completion`` object for vLLM ``RequestOutput``s (saves attached).

    With ``return_saves``, ``nnsight_saves`` decodes to one ``{name: value}``
    per choice (what the registered blocks saved), and ``nnsight_errors[i]``
    is the error one of them raised on choice ``i``, if any.
    """
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice

    choices, prompt_tokens = gather_choices(outputs)
    response = CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name,
        choices=[CompletionResponseChoice(index=c.index, text=c.text, finish_reason=c.finish_reason) for c in choices],
        usage=usage(prompt_tokens, sum(c.tokens for c in choices)), **nnsight_fields(choices, return_saves))
    return response.model_dump(mode="json", exclude_none=True)
