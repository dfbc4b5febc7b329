"""Batch runs: many prompts through an nnsight trace on Ray-hosted vLLM engines, as a Ray Data pipeline.

Entry points: ``python -m nnsight_ray.batch --config run.yaml`` (and
``nnsight-ray batch``), or from Python on a connected Ray driver::

    from nnsight_ray.batch import load_config, run_batch
    result = run_batch(load_config("run.yaml", ["engine.replicas=2"]))
    print(result.summary())

Both build the same pipeline (``pipeline``): the prompts read by Ray Data,
``nnsight_ray.data``'s processor, rows written with Ray Data's checkpointing
by prompt id. Modules, one role each: ``config`` (the YAML schema),
``prompts`` (reading a local file in preflight), ``interventions`` (what runs
in each invoke), ``preflight`` (every input checked before an engine starts),
``run_dir`` (the folder's manifest and fingerprint), ``progress``,
``pipeline`` (the run). Format and semantics: docs/batch.md.
"""

from __future__ import annotations

from typing import Any

from .config import BatchConfig, load_config
from .errors import BatchConfigError, BatchRunError

__all__ = ["BatchConfig", "BatchConfigError", "BatchResult", "BatchRunError", "load_config", "prepare", "run_batch"]


def __getattr__(name: str) -> Any:
    if name in ("run_batch", "BatchResult"):
        from . import pipeline

        return getattr(pipeline, name)
    if name == "prepare":
        from .preflight import prepare

        return prepare
    raise AttributeError(f"module 'nnsight_ray.batch' has no attribute {name!r}")
