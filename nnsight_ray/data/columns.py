"""Rows in, rows out: what the engine stage reads from a row and writes back. No Ray, no engine.

In: a row's ``prompt`` (text) or ``tokenized_prompt`` (token ids) and its
``sampling_params`` (``request``). Out: Ray Data LLM's vLLM columns
(``generated_text``, ``generated_tokens``, ``prompt_token_ids``, ...) and one
column per saved value (``success_row``), or, for a failed row, the same
columns empty and ``__inference_error__`` = ``"<Type>: <message>"``
(``failure_row``). An activation dataset's row (``activation_row``) has the
same output columns, and instead of saved values the files its token rows
are in (``ACTIVATION_COLUMNS``).

Saved values cross Ray Data (inside the row's struct column, where Arrow
takes 1-D arrays only) as ``{ARRAY: flat values, "shape", "dtype"}``: the
values a 1-D array in the model's dtype (bfloat16 as float32: numpy has no
bfloat16), which Arrow stores as a list of that dtype. ``restore_arrays``
(run before the user's postprocess) turns each back into the ``ndarray`` it
was, which Ray Data writes as a tensor column of that dtype. A failed row's
save columns are None.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = ["ACTIVATION_COLUMNS", "ARRAY", "ERROR", "OUTPUT_COLUMNS", "activation_row", "describe_error", "error_info",
           "failure_row", "host_arrays", "many_columns", "request", "restore_arrays", "success_row", "to_columns",
           "with_arrays"]

#: Ray Data LLM's per-row error column ("" on a row that succeeded).
ERROR = "__inference_error__"
#: The key of a saved value's flat values in its ``{ARRAY, "shape", "dtype"}`` form.
ARRAY = "__ndarray__"
#: The columns every output row has (as Ray Data LLM's vLLM stage), besides the saves.
OUTPUT_COLUMNS = ("prompt_token_ids", "num_input_tokens", "generated_tokens", "generated_text",
                  "num_generated_tokens", "batch_uuid", "time_taken_llm", "params", ERROR)
#: An activation dataset's columns, besides ``OUTPUT_COLUMNS``: the files (names inside ``activations.dir``) the
#: row's token rows are in, the value of those files' ``prompt_index`` column at its rows, and how many rows it has.
ACTIVATION_COLUMNS = ("activation_files", "activation_index", "activation_rows")
_RESERVED = {*OUTPUT_COLUMNS, *ACTIVATION_COLUMNS, "prompt", "tokenized_prompt", "sampling_params"}


def _plain(value: Any) -> Any:
    """Arrow hands nested lists back as ndarrays; vLLM wants lists."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def request(row: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A row's prompt (text or token ids) and sampling keywords; ``ValueError`` when it has no prompt.

    Sampling keys holding ``None`` are dropped: Ray Data fills a key another row
    of the block has with null, and vLLM's default is what the row meant.
    """
    tokens = row.get("tokenized_prompt")
    prompt = row.get("prompt")
    if tokens is not None and len(tokens):
        prompt = [int(t) for t in _plain(tokens)]
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError(f"the row has no `prompt` (text) or `tokenized_prompt` (token ids); got prompt={prompt!r}")
    sampling = _plain(row.get("sampling_params") or {})
    if not isinstance(sampling, dict):
        raise ValueError(f"sampling_params: expected a mapping of vLLM SamplingParams fields, got {sampling!r}")
    return prompt, {key: value for key, value in sampling.items() if value is not None}


def host_arrays(tensors: Sequence[Any]) -> list[np.ndarray]:
    """Torch tensors as numpy arrays of their shapes (bfloat16 as float32), views of one host copy per device
    and dtype.

    A few torch calls per (device, dtype) group, not per tensor: each torch call
    releases the GIL, and in an engine actor whose other threads keep it busy
    (the tracing thread, collection, Ray Data) each reacquire waits up to a
    switch interval (5 ms): 32 bfloat16 rows of 2048 with one busy thread took
    965-1,198 ms tensor by tensor against 32-38 ms at once
    (``python -m benchmarks.gil_convoy``).
    """
    import torch
    from torch._utils import _flatten_dense_tensors

    arrays: list[Any] = [None] * len(tensors)
    groups: dict[tuple[Any, Any], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for (_, dtype), members in groups.items():
        parts = [tensors[i] for i in members]
        flat = _flatten_dense_tensors(parts) if len(parts) > 1 else parts[0].reshape(-1)
        # Each call only where needed: every torch call is a GIL release (and a reacquire).
        if flat.requires_grad:
            flat = flat.detach()
        if flat.device.type != "cpu" or dtype == torch.bfloat16:
            flat = flat.to("cpu", torch.float32 if dtype == torch.bfloat16 else dtype)
        if dtype.is_complex:
            flat = flat.resolve_conj()
        host = flat.numpy()
        offset = 0
        for index in members:
            shape = tuple(tensors[index].shape)
            size = math.prod(shape)
            arrays[index] = host[offset:offset + size].reshape(shape)
            offset += size
    return arrays


def many_columns(invokes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any] | Exception]:
    """Each invoke's ``{name: value}`` as columns: tensors and arrays as ``{ARRAY, "shape", "dtype"}``, the
    tensors of all invokes brought to the host together (``host_arrays``). Values that are neither (numbers,
    strings, lists) pass as they are. An invoke that names a column the stage writes (``ValueError``), or
    whose tensors numpy cannot hold, has the error in its place (its row's error); the others are unaffected."""
    import torch

    made: list[dict[str, Any] | Exception] = []
    tensors: list[list[tuple[str, Any]]] = []  # per invoke: its (name, tensor)s
    for values in invokes:
        taken = [str(name) for name in values if str(name) in _RESERVED]
        made.append(ValueError(f"intervene() returned {taken[0]!r}, a column the engine stage writes; rename it")
                    if taken else {str(name): value for name, value in values.items()})
        tensors.append([] if taken else [(str(name), value) for name, value in values.items()
                                         if isinstance(value, torch.Tensor)])
    try:
        arrays = iter(host_arrays([tensor for own in tensors for _, tensor in own]))
        for columns, own in zip(made, tensors):
            for name, _ in own:
                columns[name] = next(arrays)
    except Exception:  # a dtype numpy has no form of: only the invokes that hold one fail
        for k, own in enumerate(tensors):
            try:
                for (name, _), array in zip(own, host_arrays([tensor for _, tensor in own])):
                    made[k][name] = array
            except Exception as error:
                made[k] = TypeError(f"intervene() returned a value no column can hold: {error}")
    for columns in made:
        if isinstance(columns, dict):
            for name, value in columns.items():
                if isinstance(value, np.ndarray):
                    columns[name] = {ARRAY: np.ascontiguousarray(value).reshape(-1),
                                     "shape": [int(n) for n in value.shape], "dtype": value.dtype.name}
    return made


def to_columns(values: Mapping[str, Any]) -> dict[str, Any]:
    """One invoke's ``many_columns``; raises its error (a stage column named, a value no column can hold)."""
    made = many_columns([values])[0]
    if isinstance(made, Exception):
        raise made
    return made


def success_row(idx: Any, columns: Mapping[str, Any], prompt_token_ids: list[int], generated_tokens: list[int],
                generated_text: str, batch_uuid: str, seconds: float, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """A row that succeeded: the output columns and ``columns`` (its saved values, made by ``many_columns``)."""
    return {
        "__idx_in_batch": idx,
        "prompt_token_ids": [int(t) for t in prompt_token_ids],
        "num_input_tokens": len(prompt_token_ids),
        "generated_tokens": [int(t) for t in generated_tokens],
        "generated_text": generated_text,
        "num_generated_tokens": len(generated_tokens),
        "batch_uuid": batch_uuid,
        "time_taken_llm": seconds,
        "params": str(dict(sampling)),
        ERROR: "",
        **columns,
    }


def activation_row(idx: Any, files: list[str], index: int, rows: int, prompt_token_ids: list[int],
                   generated_tokens: list[int], generated_text: str, batch_uuid: str, seconds: float,
                   sampling: Mapping[str, Any]) -> dict[str, Any]:
    """A row of an activation dataset: the output columns, and where its ``rows`` token rows are written."""
    return {**success_row(idx, {}, prompt_token_ids, generated_tokens, generated_text, batch_uuid, seconds, sampling),
            "activation_files": list(files), "activation_index": int(index), "activation_rows": int(rows)}


def failure_row(idx: Any, error: str, names: list[str], batch_uuid: str) -> dict[str, Any]:
    """A failed row: the output columns empty (as Ray Data LLM's), each known save column None."""
    return {
        "__idx_in_batch": idx,
        "prompt_token_ids": None,
        "num_input_tokens": 0,
        "generated_tokens": [],
        "generated_text": "",
        "num_generated_tokens": 0,
        "batch_uuid": batch_uuid,
        "time_taken_llm": -1.0,
        "params": "",
        ERROR: error,
        **{name: None for name in names},
    }


_TYPED_MESSAGE = re.compile(r"^(\w+(?:\.\w+)*): (.*)$", re.S)


def error_info(type_name: str, message: str, traceback: str | None = None) -> dict[str, Any]:
    """``{"type", "message", "traceback"}``, unwrapping nnsight's ``RuntimeError("ValueError: ...")``."""
    head, _, rest = message.partition("\n\nIntervention traceback:\n")
    match = _TYPED_MESSAGE.match(head)
    if type_name in ("RuntimeError", "RequestError") and match:
        type_name, head = match.group(1).rsplit(".", 1)[-1], match.group(2)
    elif match and match.group(1) == type_name:
        head = match.group(2)
    info = {"type": type_name, "message": head.strip()}
    # The intervention's own traceback (inside nnsight's message) points at the
    # user's line; the deferred one only at where it was re-raised.
    if rest or traceback:
        info["traceback"] = (rest or traceback).rstrip()
    return info


def describe_error(error: BaseException) -> str:
    """``"<Type>: <message>"`` of a row's failure; an intervention's own type and message, not nnsight's wrapper."""
    deferred = getattr(error, "deferred", None)  # an intervention's error: nnsight's wire form
    if isinstance(deferred, dict):
        info = error_info(deferred.get("type_name") or "Exception", deferred.get("message") or "",
                          deferred.get("traceback"))
    else:
        info = error_info(type(error).__name__, str(error))
    return f"{info['type']}: {info['message']}"


def restore_arrays(row: dict[str, Any]) -> dict[str, Any]:
    """The saved values of a row back as the ndarrays they were (a 0-d one as a numpy scalar); in place."""
    for name, value in row.items():
        if isinstance(value, Mapping) and value.get(ARRAY) is not None:
            array = np.asarray(value[ARRAY], dtype=np.dtype(value["dtype"]))
            shape = [int(n) for n in value["shape"]]
            row[name] = array.reshape(shape) if shape else array.reshape(())[()]
    return row


def with_arrays(postprocess: Callable[[dict[str, Any]], dict[str, Any]] | None) -> Callable:
    """``postprocess`` (or the identity) seeing the saved values as ndarrays."""

    def restored(row: dict[str, Any]) -> dict[str, Any]:
        row = restore_arrays(row)
        return postprocess(row) if postprocess is not None else row

    return restored
