"""Interventions as a Ray Data LLM processor: saved values as columns of a Ray Dataset.

::

    import ray
    from ray.data.llm import build_processor
    from nnsight_ray.data import NNsightEngineProcessorConfig

    config = NNsightEngineProcessorConfig(model_source=path, concurrency=1, batch_size=16,
                                          saves=[{"location": "model.layers.1.output", "tokens": "last"}])
    processor = build_processor(config, preprocess=lambda row: {
        "prompt": row["text"], "sampling_params": {"max_tokens": 8, "temperature": 0.0}})
    ds = processor(ray.data.read_parquet(path))

Importing this package registers the builder with Ray Data LLM's registry, so
``ray.data.llm.build_processor`` takes the config; ``build_processor`` here is
the same call. Modules: ``config`` (the config), ``columns`` (rows in and
out, no Ray), ``stage`` (the engine stage on the actor pool), ``processor``
(the builder and its preflight). Users' guide: docs/data.md.
"""

from __future__ import annotations

from .config import NNsightEngineProcessorConfig, SaveSpec
from .processor import build_processor

__all__ = ["NNsightEngineProcessorConfig", "SaveSpec", "build_processor"]
