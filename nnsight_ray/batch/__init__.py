"""Batch runs: many prompts through an nnsight trace on Ray-hosted vLLM engines, to Parquet files.

Entry points: ``python -m nnsight_ray.batch --config run.yaml`` (and
``nnsight-ray batch``): a Ray Data pipeline over ``nnsight_ray.data``
(``pipeline``) for runs that save values per prompt, the hand-written
runner for activation datasets and ``--connect``. From Python (the runner)::

    from nnsight_ray.batch import load_config, run_batch
    result = run_batch(load_config("run.yaml", ["engine.replicas=2"]))
    print(result.summary())

Modules, one role each: ``config`` (the YAML schema), ``prompts`` (reading
them), ``interventions`` (what runs in each invoke), ``preflight`` (every
input checked before an engine starts), ``replicas`` (the engines and their
traces: the Ray edge), ``scheduler`` (which prompts go where, failure rules),
``shards`` (the run folder on disk), ``progress``, ``runner`` (the run
itself), ``pipeline`` (the Ray Data path). Format and semantics: docs/batch.md.
"""

from __future__ import annotations

from typing import Any

from .config import BatchConfig, load_config
from .errors import BatchConfigError, BatchRunError

__all__ = ["BatchConfig", "BatchConfigError", "BatchResult", "BatchRunError", "load_config", "prepare", "run_batch"]


def __getattr__(name: str) -> Any:
    if name in ("run_batch", "prepare", "BatchResult"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'nnsight_ray.batch' has no attribute {name!r}")
