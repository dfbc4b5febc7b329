"""The prompts as a Ray Dataset: local files or any URI Ray Data reads, checked before any engine starts.

``read_dataset`` gives a Ray Data ``Read`` of two columns (the id and the
text field), which is what Ray Data's checkpointing filters on a rerun:
``read_json`` (``.jsonl``), ``read_parquet`` (``.parquet``), ``TextLines``
(``.txt``: one prompt per line, its id the line number). ``check_source``
reads a URI's schema and row count once the driver joined the cluster.
``local_footer_readers`` keeps a local Parquet read from starting Ray Data's
32 footer-reader actors.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ray.data.datasource import Datasource, ReadTask

from .config import PromptsConfig
from .errors import BatchConfigError

__all__ = ["FOOTER_READERS", "TextLines", "check_source", "local_footer_readers", "read_dataset"]


class TextLines(Datasource):
    """A ``.txt`` prompt file as rows: id = the 1-based line number (a string), blank lines skipped.

    A ``Read`` of Ray Data's own (``read_datasource``), so checkpointing filters it like its readers.
    """

    def __init__(self, path: str, id_field: str, text_field: str) -> None:
        self.path, self.id_field, self.text_field = path, id_field, text_field

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        from ray.data.block import BlockMetadata

        path, id_field, text_field = self.path, self.id_field, self.text_field

        def read():
            import pyarrow as pa
            import pyarrow.fs as pafs

            filesystem, where = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), path)
            with filesystem.open_input_stream(where) as handle:
                lines = handle.read().decode().splitlines()
            kept = [(str(number), line) for number, line in enumerate(lines, 1) if line.strip()]
            yield pa.table({id_field: [i for i, _ in kept], text_field: [t for _, t in kept]})

        metadata = BlockMetadata(num_rows=None, size_bytes=None, input_files=(path,), exec_stats=None)
        return [ReadTask(read, metadata, per_task_row_limit=per_task_row_limit)]


def _location(source: PromptsConfig) -> tuple[str, Any]:
    """The path as Ray Data takes it, and a filesystem for the schemes pyarrow does not know (``hf://``)."""
    if source.remote:
        if source.path.startswith("hf://"):
            from huggingface_hub import HfFileSystem

            return source.path, HfFileSystem()
        return source.path, None
    return str(Path(source.path.removeprefix("file://")).expanduser().resolve()), None


FOOTER_READERS = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"


@contextlib.contextmanager
def local_footer_readers(*paths: str | Path) -> Iterator[None]:
    """One Parquet footer reader while every path is on the local disk, unless the user set ``FOOTER_READERS``.

    Ray Data (datasource V2) lists a Parquet read by reading every file's footer
    on a pool of actors, 32 by default, started for each read (the prompts, the
    checkpoint a rerun loads) and sized for object storage. On a local disk one
    reader does the work, and 32 worker processes cost ~40 s on a 2-core machine
    (docs/ci.md). Ray reads the variable in the driver, where a read is planned,
    when a read is built (``read_parquet``) and when it runs; set here for this block only.
    """
    if FOOTER_READERS in os.environ or any("://" in str(path) for path in paths):
        yield
        return
    os.environ[FOOTER_READERS] = "1"
    try:
        yield
    finally:
        os.environ.pop(FOOTER_READERS, None)


def read_dataset(source: PromptsConfig):
    """The prompts as a Ray Dataset of two columns, ``id_field`` and ``text_field`` (a ``Read``: resumable)."""
    import ray.data

    path, filesystem = _location(source)
    columns = [source.id_field, source.text_field]
    if source.kind == "parquet":
        return ray.data.read_parquet(path, filesystem=filesystem, columns=columns)
    if source.kind == "jsonl":
        return ray.data.read_json(path, filesystem=filesystem).select_columns(columns)
    return ray.data.read_datasource(TextLines(path, *columns))


def check_source(source: PromptsConfig) -> int:
    """A URI's prompts, checked through Ray Data before any engine starts: the fields exist; returns the count."""
    try:
        with local_footer_readers(source.path):
            dataset = read_dataset(source)
            names = dataset.schema().names
            count = dataset.count()
    except Exception as error:
        raise BatchConfigError(f"prompts.path {source.path!r}: Ray Data cannot read it "
                               f"({type(error).__name__}: {error})") from None
    missing = [f for f in (source.id_field, source.text_field) if f not in names]
    if missing:
        raise BatchConfigError(f"prompts.path {source.path!r}: no column {missing[0]!r} (columns: {names}); "
                               "set prompts.id_field / prompts.text_field")
    return count
