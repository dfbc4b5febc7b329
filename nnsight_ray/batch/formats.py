"""The batch output formats, one object each: everything that differs between them, asked by the runner.

``output_format(config)`` picks the object once, from ``output.format``:

- ``ParquetRows`` (``parquet``): each chunk of ``runner.prompts_per_trace``
  prompts is one nnsight trace whose invokes return the saved values; a shard
  is one Parquet file of one row per prompt, written by the driver
  (``RunDir.write_shard``);
- ``ActivationDatasets`` (``activations``): each chunk is a whole shard sent as
  plain requests whose rows the engine's ranks keep and then write as
  token-major safetensors files themselves (``extract_async``, then
  ``extract_commit``); the driver writes only the shard's record
  (``RunDir.write_record``), after every file it lists.

What each one answers: the data files' suffix, the prompts per request, the
keys it adds to the run's fingerprint, whether an engine can write it, how a
chunk is submitted and finished, how a finished shard is recorded, the
manifest's description of its layout, and which shards on disk are finished
(resume). Pure Python over the Ray edge in ``replicas``.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from .config import BatchConfig
from .errors import BatchConfigError
from .replicas import (InFlight, Replica, collect_commits, commit_extract, discard_extract, part_name, part_rows,
                       submit_extract, submit_trace)
from .scheduler import Chunk, ShardState
from .shards import RunDir, ShardPlan, ShardRecord

__all__ = ["ActivationDatasets", "OutputFormat", "ParquetRows", "output_format"]


class OutputFormat:
    """One output format of a batch run (``output.format``); subclasses say how it differs."""

    #: ``output.format``'s value.
    name = ""
    #: The suffix of the shards' data files.
    suffix = ""

    def __init__(self, config: BatchConfig) -> None:
        self.config = config

    def fingerprint(self) -> dict[str, Any]:
        """Keys this format adds to the run's fingerprint (a folder of other settings is not resumed)."""
        return {}

    def chunk_size(self) -> int:
        """Prompts per request (one chunk of the scheduler)."""
        return self.config.runner.prompts_per_trace

    def check_engine(self, name: str, model: Any) -> None:
        """Raise ``BatchConfigError`` when engine replica ``name`` cannot produce this format."""

    def submit(self, prepared: Any, replica: Replica, chunk: Chunk, texts: list[str], sampling: dict) -> InFlight:
        """Send one chunk to ``replica``; the entry holds the ref its result comes back on."""
        raise NotImplementedError

    def resolved(self, entry: InFlight, outcome: Any) -> Any:
        """A request's ``outcome`` (a result or the exception) -> the chunk's result: ``{"rows": [...]}`` (one
        row per prompt, ``None`` for a prompt without one; ``"bytes"``: what was written), an exception, or
        the entry of a next phase still in flight."""
        return outcome

    def write_shard(self, run_dir: RunDir, state: ShardState, record: ShardRecord,
                    columns: Sequence[str]) -> ShardRecord:
        """Write a complete shard (its rows are in ``state``); returns its record, as stored."""
        raise NotImplementedError

    def finished(self, run_dir: RunDir, plans: Sequence[ShardPlan]) -> dict[int, ShardRecord]:
        """The shards of ``plans`` already complete in ``run_dir`` (written from the same inputs)."""
        raise NotImplementedError

    def describe(self, prepared: Any) -> dict[str, Any]:
        """The manifest's ``columns``: what the shards hold."""
        raise NotImplementedError


class ParquetRows(OutputFormat):
    """``output.format: parquet``: a trace per chunk, one Parquet row per prompt (any save, any intervention)."""

    name = "parquet"
    suffix = "parquet"

    def submit(self, prepared: Any, replica: Replica, chunk: Chunk, texts: list[str], sampling: dict) -> InFlight:
        ref = submit_trace(replica.model, texts, prepared.fn, sampling)
        return InFlight(chunk, replica, time.monotonic(), ref=ref)

    def write_shard(self, run_dir: RunDir, state: ShardState, record: ShardRecord,
                    columns: Sequence[str]) -> ShardRecord:
        record.file = state.plan.file
        return run_dir.write_shard(state.plan, state.rows, columns, record)

    def finished(self, run_dir: RunDir, plans: Sequence[ShardPlan]) -> dict[int, ShardRecord]:
        return run_dir.finished(plans)

    def describe(self, prepared: Any) -> dict[str, Any]:
        if prepared.config.intervention:
            return {"from": f"intervene() in {prepared.config.intervention}"}
        order = [r.name for r in prepared.reads]
        return {
            s.location: {"tokens": s.tokens, "shape_column": s.location + ".shape",
                         "read_order": order.index(s.location) if s.location in order else None}
            for s in prepared.config.saves or []
        }


class ActivationDatasets(OutputFormat):
    """``output.format: activations``: the ranks write every token's rows of ``saves`` as safetensors files."""

    name = "activations"
    suffix = "safetensors"

    @property
    def locations(self) -> list[str]:
        return [s.location for s in self.config.saves or []]

    def fingerprint(self) -> dict[str, Any]:
        output = self.config.output
        # "generated" only when set: folders written before it existed still resume.
        return {"format": "activations", "dtype": output.dtype, **({"generated": True} if output.generated else {})}

    def chunk_size(self) -> int:
        # A chunk is a whole shard, so its rows land in one file per pipeline stage.
        return self.config.output.shard_size

    def check_engine(self, name: str, model: Any) -> None:
        # Activation files are written by RayVLLM's ranks: any other engine is refused up front.
        if not hasattr(getattr(model, "vllm_entrypoint", None), "extract_async"):
            raise BatchConfigError(
                f"output.format=activations needs RayVLLM engines (their ranks write the files); replica "
                f"{name} is a {type(model).__name__}. Use output.format=parquet with it.")

    def submit(self, prepared: Any, replica: Replica, chunk: Chunk, texts: list[str], sampling: dict) -> InFlight:
        output = self.config.output
        part = part_name(chunk.shard, chunk.positions, len(prepared.plans[chunk.shard].prompts))
        base = chunk.shard * output.shard_size
        dtype = None if output.dtype == "auto" else output.dtype
        ref = submit_extract(replica.model, texts, part, str(prepared.run_dir.path), self.locations,
                             [base + p for p in chunk.positions], dtype, sampling, output.generated)
        return InFlight(chunk, replica, time.monotonic(), part=part, ref=ref)

    def resolved(self, entry: InFlight, outcome: Any) -> Any:
        """Two phases: the outputs are back -> the ranks commit the part's files; the commits are back -> its rows."""
        model = entry.replica.model
        if entry.commits is None:
            if isinstance(outcome, BaseException):
                discard_extract(model, entry.part)
                return outcome
            commits = commit_extract(model, entry.part, self.config.output.fsync)
            return InFlight(entry.chunk, entry.replica, entry.submitted, part=entry.part, commits=commits,
                            ref=commits[0])
        if isinstance(outcome, BaseException):
            return outcome
        written = collect_commits(entry.commits, entry.part)
        if isinstance(written, BaseException):
            return written
        base = entry.chunk.shard * self.config.output.shard_size
        files, counts = part_rows(written, [base + position for position in entry.chunk.positions])
        # None: the ranks hold no rows of it (vLLM never ran it whole)
        rows = [None if count is None else {"tokens": count, "files": files} for count in counts]
        return {"rows": rows, "bytes": sum(w.get("bytes", 0) for w in written)}

    def write_shard(self, run_dir: RunDir, state: ShardState, record: ShardRecord,
                    columns: Sequence[str]) -> ShardRecord:
        """The record only (the ranks wrote the files): the files, and each prompt's token rows in them."""
        values = [(state.rows.get(i) or {}).get("values") or {} for i in state.plan.ids]
        record.files = sorted({name for value in values for name in value.get("files", [])})
        record.tokens = [value.get("tokens", 0) for value in values]
        record.rows = sum(record.tokens)
        return run_dir.write_record(state.plan, record)

    def finished(self, run_dir: RunDir, plans: Sequence[ShardPlan]) -> dict[int, ShardRecord]:
        return run_dir.finished_records(plans)

    def describe(self, prepared: Any) -> dict[str, Any]:
        return {"format": "activations", "layout": "token-major safetensors: one [rows, hidden] tensor per "
                "location, plus token_ids, prompt_index (row of the prompt file) and position (in the prompt)",
                "locations": self.locations, "dtype": self.config.output.dtype}


FORMATS: dict[str, type[OutputFormat]] = {f.name: f for f in (ParquetRows, ActivationDatasets)}


def output_format(config: BatchConfig) -> OutputFormat:
    """The format object of ``config.output.format``."""
    return FORMATS[config.output.format](config)
