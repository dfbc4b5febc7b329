"""A run's folder: shard files, ``manifest.json``, ``errors.jsonl``. Pure I/O, no Ray.

Layout of ``output.dir`` (``output.format: parquet``)::

    shard-00000.parquet   one row per prompt of shard 0 (prompts 0..shard_size-1, file order)
    shard-00001.parquet   ...
    manifest.json         config, versions, replicas' topology, per-shard ids/counts/timings
    errors.jsonl          one line per prompt whose intervention or request failed

With ``output.format: activations`` the ranks write each shard's safetensors
files (``shard-00000.safetensors``, one per pipeline stage) and this writes the
shard's record beside them (``shard-00000.json``) once they are complete;
``formats`` says which of these a run uses.

Shard format (Parquet, written with pyarrow; readable with pyarrow, pandas,
polars, DuckDB, Spark): columns ``id`` (string), ``prompt`` (string), ``error``
(string, null unless that prompt failed), and per saved value ``<name>``
(``list<float32>``, the tensor flattened in C order, cast to float32) and
``<name>.shape`` (``list<int32>``). A failed prompt keeps its row, with nulls
for the values, so every planned id is in exactly one shard.

Atomicity and resume: a shard is written to a temporary file in the same folder,
fsynced, then renamed over its final name, so a shard file either is complete
or does not exist. Its Parquet metadata (key ``nnsight_ray``) holds its record:
index, ids, errors, timings, and the digest of the run's inputs. A rerun
counts a shard finished when its file exists and its record has the same
digest and ids as the plan; the manifest is rebuilt from those records, so a
run killed between a shard's rename and the manifest write loses nothing.

Before any of it, ``check_writable`` (preflight) refuses an ``output.dir`` that
cannot be written, or whose path runs through a file, naming the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from .errors import BatchConfigError
from .prompts import Prompt

__all__ = ["ShardPlan", "ShardRecord", "RunDir", "check_writable", "plan_shards", "fingerprint_digest", "to_array"]

FORMAT = "nnsight_ray.batch/1"
METADATA_KEY = b"nnsight_ray"
SHAPE_SUFFIX = ".shape"


@dataclass(frozen=True)
class ShardPlan:
    """Which prompts a shard holds: fixed by the prompt file and ``shard_size``."""

    index: int
    prompts: tuple[Prompt, ...]

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self.prompts]

    @property
    def file(self) -> str:
        return f"shard-{self.index:05d}.parquet"


def record_file(plan: ShardPlan) -> str:
    """An activation shard's record (``output.format=activations``): written once its files are complete."""
    return f"shard-{plan.index:05d}.json"


def plan_shards(prompts: Sequence[Prompt], shard_size: int) -> list[ShardPlan]:
    return [
        ShardPlan(index, tuple(prompts[start : start + shard_size]))
        for index, start in enumerate(range(0, len(prompts), shard_size))
    ]


@dataclass
class ShardRecord:
    """What the manifest says about a finished shard (also stored in the shard file or its record file).

    A record names only files that exist: ``file`` for a Parquet shard;
    ``files`` (with ``rows`` and per-prompt ``tokens``, in ``ids`` order) for
    an activation shard. Fields left ``None`` are not written.
    """

    index: int
    file: str | None  # parquet: the shard's file
    ids: list[str]
    count: int
    errors: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0
    finished_at: float = 0.0
    replica: list[str] = field(default_factory=list)
    attempts: int = 1
    digest: str = ""
    files: list[str] | None = None  # activations: the safetensors files the ranks wrote
    rows: int | None = None  # activations: token rows in those files
    tokens: list[int] | None = None  # activations: each prompt's token rows (0: none, it failed)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShardRecord":
        return cls(**{"file": None, **{k: data[k] for k in cls.__dataclass_fields__ if k in data}})

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def check_writable(path: Path) -> None:
    """Refuse (``BatchConfigError``) an ``output.dir`` a run could not write: a file on its path, or no write access.

    Nothing is left behind: the probe is an anonymous temporary file in the
    folder (or, for a folder still to be created, in its nearest existing parent).
    """
    where = str(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "it is a file" if existing == path else f"{str(existing)!r} on its path is a file"
        raise BatchConfigError(f"output.dir {where!r}: {what}, not a folder; choose another output.dir "
                               "(--set output.dir=...)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        place = "cannot write there" if existing == path else f"cannot create it in {str(existing)!r}"
        raise BatchConfigError(f"output.dir {where!r}: {place} ({type(error).__name__}: {error.strerror or error}); "
                               "choose a folder you can write (--set output.dir=...)") from None


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()


def to_array(value: Any):
    """A saved value as a float32 numpy array (tensors of any dtype, numbers, nested lists)."""
    import numpy as np

    try:
        import torch

        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", torch.float32).numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return np.asarray(value, dtype=np.float32)


class RunDir:
    """The run folder: resume checks, atomic shard and manifest writes."""

    def __init__(self, path: str | os.PathLike, fingerprint: dict[str, Any]) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.digest = fingerprint_digest(fingerprint)

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def errors_path(self) -> Path:
        return self.path / "errors.jsonl"

    # -- before the run -------------------------------------------------------

    def previous_manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            raise BatchConfigError(f"output.dir {str(self.path)!r}: a file on its path is not a folder; choose "
                                   "another output.dir (--set output.dir=...)") from None
        except (OSError, ValueError) as error:
            raise BatchConfigError(
                f"output.dir {str(self.path)!r}: manifest.json is unreadable ({error}); move it away to start over"
            ) from None

    def check_compatible(self) -> dict[str, Any] | None:
        """Refuse to resume a folder written from other inputs; returns the old manifest."""
        previous = self.previous_manifest()
        if previous is None:
            return None
        old = previous.get("fingerprint") or {}
        if fingerprint_digest(old) == self.digest:
            return previous
        changed = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
        raise BatchConfigError(
            f"output.dir {str(self.path)!r} holds a run of different inputs (changed: {', '.join(changed)}); "
            "resuming would mix them. Use another output.dir (--set output.dir=...) or delete that folder."
        )

    def prepare(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # checked in preflight; changed since
            raise BatchConfigError(f"output.dir {str(self.path)!r}: cannot create it ({type(error).__name__}: "
                                   f"{error.strerror or error})") from None
        for stale in self.path.glob("*.tmp-*"):
            try:
                stale.unlink()
            except OSError:
                pass

    def finished(self, plans: Iterable[ShardPlan]) -> dict[int, ShardRecord]:
        """Parquet shards whose files are complete and belong to this plan."""
        import pyarrow.parquet as pq

        done = {}
        for plan in plans:
            path = self.path / plan.file
            if not path.exists():
                continue
            try:
                metadata = pq.read_schema(path).metadata or {}
                record = ShardRecord.from_json(json.loads(metadata[METADATA_KEY]))
            except Exception:
                continue  # unreadable or foreign: redo it
            if record.digest == self.digest and record.ids == plan.ids:
                done[plan.index] = record
        return done

    def finished_records(self, plans: Iterable[ShardPlan]) -> dict[int, ShardRecord]:
        """Activation shards: a record file (written last, after the ranks' files) whose files are all whole."""
        from .._internal.extract.safetensors_io import safetensors_complete

        done = {}
        for plan in plans:
            try:
                record = ShardRecord.from_json(json.loads((self.path / record_file(plan)).read_text()))
            except (OSError, ValueError, TypeError):
                continue
            if (record.digest == self.digest and record.ids == plan.ids
                    and all(safetensors_complete(str(self.path / name)) for name in record.files or [])):
                record.file = None  # older records named a Parquet file that never existed
                done[plan.index] = record
        return done

    # -- during the run -------------------------------------------------------

    def write_record(self, plan: ShardPlan, record: ShardRecord) -> ShardRecord:
        """Activations: the shard is done once its record is written (after every file it lists).

        Files of this shard that the record does not list (an earlier attempt's, or a
        killed run's) are removed, so a folder holds every token row exactly once.
        """
        record.digest = self.digest
        keep = set(record.files or [])
        for stale in self.path.glob(f"shard-{plan.index:05d}*.safetensors"):
            if stale.name not in keep:
                stale.unlink(missing_ok=True)
        text = json.dumps(record.to_json(), default=str)
        self._atomic(self.path / record_file(plan), lambda handle: handle.write(text.encode()))
        return record

    def write_shard(self, plan: ShardPlan, rows: dict[str, dict[str, Any]], columns: Sequence[str],
                    record: ShardRecord) -> ShardRecord:
        """Write one shard atomically. ``rows[id]`` is ``{"error": str|None, "values": {name: value}}``."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        names = list(columns)
        for prompt in plan.prompts:
            for name in rows[prompt.id].get("values") or {}:
                if name not in names:
                    names.append(name)
        arrays: dict[str, Any] = {
            "id": pa.array(plan.ids, pa.string()),
            "prompt": pa.array([p.text for p in plan.prompts], pa.string()),
            "error": pa.array([rows[p.id].get("error") for p in plan.prompts], pa.string()),
        }
        for name in names:
            flat, shapes = [], []
            for prompt in plan.prompts:
                value = (rows[prompt.id].get("values") or {}).get(name)
                if value is None:
                    flat.append(None)
                    shapes.append(None)
                else:
                    array = to_array(value)
                    flat.append(array.ravel())
                    shapes.append(list(array.shape))
            arrays[name] = pa.array(flat, pa.list_(pa.float32()))
            arrays[name + SHAPE_SUFFIX] = pa.array(shapes, pa.list_(pa.int32()))
        record.digest = self.digest
        table = pa.table(arrays).replace_schema_metadata({METADATA_KEY: json.dumps(record.to_json())})
        self._atomic(self.path / plan.file, lambda handle: pq.write_table(table, handle))
        return record

    def write_manifest(self, manifest: dict[str, Any], records: dict[int, ShardRecord]) -> None:
        """Manifest and errors.jsonl, each atomically; errors are derived from the shard records."""
        ordered = [records[i] for i in sorted(records)]
        manifest = {**manifest, "format": FORMAT, "fingerprint": self.fingerprint,
                    "fingerprint_digest": self.digest, "shards": [r.to_json() for r in ordered]}
        text = json.dumps(manifest, indent=2, default=str) + "\n"
        self._atomic(self.manifest_path, lambda handle: handle.write(text.encode()))
        lines = "".join(
            json.dumps({"shard": r.index, **error}) + "\n" for r in ordered for error in r.errors
        )
        self._atomic(self.errors_path, lambda handle: handle.write(lines.encode()))

    def _atomic(self, path: Path, write) -> None:
        tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            with open(tmp, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
