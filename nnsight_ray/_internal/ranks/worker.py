"""The ``worker_cls`` every rank is given: resolved in the rank's own process.

vLLM imports ``worker_cls`` by its dotted path inside each rank, so choosing the
class here, at import, uses the platform of the node the rank actually runs on
(CPU build or GPU build), not that of the driver or engine process, which may
sit on a CPU-only head node of a GPU cluster.
"""

from __future__ import annotations

from vllm.platforms import current_platform

if current_platform.is_cpu():
    from .cpu_worker import NNsightCPUWorker as NNsightWorker
else:
    from .gpu_worker import NNsightRayGPUWorker as NNsightWorker

__all__ = ["NNsightWorker"]
