"""Read a run's prompts: ``.jsonl``, ``.txt`` or ``.parquet``, ids unique, order kept.

Ids are strings in every format (a JSON number id ``3`` becomes ``"3"``), so
shards, manifests and ``errors.jsonl`` key prompts the same way whatever the
source. A ``.txt`` file holds one prompt per line; its id is the 1-based line
number and blank lines are skipped (their numbers are not reused).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import BatchConfigError

__all__ = ["Prompt", "file_digest", "read_prompts"]


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def read_prompts(path: str | Path, id_field: str = "id", text_field: str = "prompt",
                 kind: str | None = None) -> list[Prompt]:
    """All prompts of ``path`` in file order; ``BatchConfigError`` says what and where.

    ``kind`` (``jsonl``, ``txt``, ``parquet``): the format, default the path's suffix.
    """
    path = Path(path)
    if not path.is_file():
        raise BatchConfigError(
            f"prompts.path {str(path)!r}: no such file (relative paths are read from {Path.cwd()})"
        )
    suffix = f".{kind}" if kind else path.suffix.lower()
    if suffix == ".jsonl":
        prompts = _jsonl(path, id_field, text_field)
    elif suffix == ".txt":
        prompts = [
            Prompt(str(number), line)
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if line.strip()
        ]
    elif suffix == ".parquet":
        prompts = _parquet(path, id_field, text_field)
    else:
        raise BatchConfigError(f"prompts.path {str(path)!r}: unsupported format {suffix!r} (.jsonl, .txt, .parquet)")
    if not prompts:
        raise BatchConfigError(f"prompts.path {str(path)!r}: no prompts in the file")
    _check_unique(prompts, path)
    return prompts


def _jsonl(path: Path, id_field: str, text_field: str) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"prompts.path {str(path)!r} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise BatchConfigError(f"{where}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise BatchConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [f for f in (id_field, text_field) if f not in row]
        if missing:
            raise BatchConfigError(
                f"{where}: no field {missing[0]!r} (fields: {sorted(row)}); set prompts.id_field / prompts.text_field"
            )
        prompts.append(Prompt(_id(row[id_field], where), _text(row[text_field], where)))
    return prompts


def _parquet(path: Path, id_field: str, text_field: str) -> list[Prompt]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as error:
        raise BatchConfigError(f"prompts.path {str(path)!r}: not a readable Parquet file ({error})") from None
    missing = [f for f in (id_field, text_field) if f not in schema.names]
    if missing:
        raise BatchConfigError(
            f"prompts.path {str(path)!r}: no column {missing[0]!r} (columns: {schema.names}); "
            "set prompts.id_field / prompts.text_field"
        )
    table = pq.read_table(path, columns=[id_field, text_field])
    ids, texts = table.column(id_field).to_pylist(), table.column(text_field).to_pylist()
    return [
        Prompt(_id(i, f"prompts.path {str(path)!r} row {n}"), _text(t, f"prompts.path {str(path)!r} row {n}"))
        for n, (i, t) in enumerate(zip(ids, texts))
    ]


def _id(value: object, where: str) -> str:
    if value is None or isinstance(value, (dict, list)):
        raise BatchConfigError(f"{where}: id {value!r} is not a string or number")
    return str(value)


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise BatchConfigError(f"{where}: prompt text should be a string, got {type(value).__name__}")
    return value


def _check_unique(prompts: list[Prompt], path: Path) -> None:
    seen: set[str] = set()
    duplicates: list[str] = []
    for prompt in prompts:
        if prompt.id in seen:
            duplicates.append(prompt.id)
        seen.add(prompt.id)
    if duplicates:
        raise BatchConfigError(
            f"prompts.path {str(path)!r}: {len(duplicates)} duplicate id(s), e.g. {duplicates[:5]}; "
            "ids key the saved rows and must be unique"
        )


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes: what a resumed run compares its inputs with."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
