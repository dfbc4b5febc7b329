"""Platform-dependent choices, decided in one place.

vLLM picks its platform (CUDA, ROCm, CPU, ...) from what is installed. The
nnsight worker class is resolved inside each rank (``worker.NNsightWorker``),
so a rank always gets the class of the node it runs on. What a rank *asks Ray
for* (CPU or GPU bundles) is decided from the cluster's resources
(``options.RankPlacement.device``), not from the caller's platform: the caller
may be a CPU-only head node of a GPU cluster. Nothing here is a user flag.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

WORKER_CLS = "nnsight_ray._internal.ranks.worker.NNsightWorker"

# KV cache per CPU rank unless the user sets VLLM_CPU_KVCACHE_SPACE or
# kv_cache_memory_bytes: vLLM's CPU default reserves a fraction of the whole
# NUMA node's RAM per rank, which fails as soon as several ranks share a machine.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


# vLLM's FlashInfer sampler is JIT-compiled (nvcc, single-threaded) on its first use on a
# machine: a fresh GPU machine's first engine start sat for minutes, saying nothing. Its
# PyTorch sampler needs no build; greedy and plain top-k/top-p sampling give the same
# tokens. Our engines default to it; set VLLM_USE_FLASHINFER_SAMPLER=1 to have FlashInfer's.
ENGINE_ENV_DEFAULTS = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def engine_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``ENGINE_ENV_DEFAULTS`` not already set in ``environ`` (``os.environ`` by default)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in ENGINE_ENV_DEFAULTS.items() if k not in environ}


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def worker_cls() -> str:
    """The dotted ``worker_cls`` vLLM builds in every rank (resolved there, per node)."""
    return WORKER_CLS


def engine_defaults(kwargs: dict) -> dict:
    """The platform's engine-argument defaults, never overriding the user's."""
    kwargs = dict(kwargs)
    if is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kwargs.setdefault("kv_cache_memory_bytes", DEFAULT_CPU_KV_CACHE_BYTES)
    return kwargs


@contextlib.contextmanager
def meta_build_without_accelerator() -> Iterator[None]:
    """Let nnsight's meta-only model build on a machine with no accelerator.

    nnsight 0.8.1's ``VLLM._load_meta`` runs vLLM's model loader, whose
    ``BaseModelLoader.load_model`` (vllm 0.32.0) calls
    ``torch.accelerator.empty_cache()``; with no accelerator, torch raises
    ``RuntimeError: Cannot access accelerator device when none is available``.
    Emptying a cache that does not exist is a no-op by meaning, so for the
    duration of the meta build, and only when torch sees no accelerator, the
    call is answered as one. vLLM's own ``CPUModelRunner`` makes the same
    substitution process-wide (``_set_torch_accelerator_to_noop``); this one is
    scoped and restored. It can go when vLLM guards the call
    (``if torch.accelerator.is_available()``).
    """
    import torch

    if torch.accelerator.current_accelerator() is not None:
        yield
        return
    original = torch.accelerator.empty_cache
    torch.accelerator.empty_cache = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.accelerator.empty_cache = original
