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

from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["ACTIVATION_COLUMNS", "ARRAY", "ERROR", "OUTPUT_COLUMNS", "activation_row", "describe_error",
           "failure_row", "request", "restore_arrays", "success_row", "to_columns", "with_arrays"]

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


def to_columns(values: Mapping[str, Any]) -> dict[str, Any]:
    """One invoke's ``{name: value}`` as columns: tensors and arrays as ``{ARRAY, "shape", "dtype"}``.

    Values that are neither (numbers, strings, lists) pass as they are.
    """
    import torch

    columns: dict[str, Any] = {}
    for name, value in values.items():
        name = str(name)
        if name in _RESERVED:
            raise ValueError(f"intervene() returned {name!r}, a column the engine stage writes; rename it")
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            value = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
        if isinstance(value, np.ndarray):
            value = {ARRAY: np.ascontiguousarray(value).reshape(-1), "shape": [int(n) for n in value.shape],
                     "dtype": value.dtype.name}
        columns[name] = value
    return columns


def success_row(idx: Any, values: Mapping[str, Any], prompt_token_ids: list[int], generated_tokens: list[int],
                generated_text: str, batch_uuid: str, seconds: float, sampling: Mapping[str, Any]) -> dict[str, Any]:
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
        **to_columns(values),
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


def describe_error(error: BaseException) -> str:
    """``"<Type>: <message>"`` of a row's failure; an intervention's own type and message, not nnsight's wrapper."""
    from ..batch.replicas import error_info

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
