"""nnsight interventions on vLLM engines spread over a Ray cluster.

Public surface: ``LocalVLLM`` (nnsight's in-process ``VLLM`` on CPU or GPU,
optionally with Ray rank actors), ``build_model`` (tiny test checkpoints) and
the typed errors. Heavy imports (vllm, torch, ray) happen on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LocalVLLM", "RayVLLM", "build_model", "ensure_model", "errors"]


def __getattr__(name: str) -> Any:
    if name == "LocalVLLM":
        from .local import LocalVLLM

        return LocalVLLM
    if name == "RayVLLM":
        from .ray_vllm import RayVLLM

        return RayVLLM
    if name in ("build_model", "ensure_model"):
        from . import models

        return getattr(models, name)
    if name == "errors":
        from . import errors

        return errors
    raise AttributeError(f"module 'nnsight_ray' has no attribute {name!r}")
