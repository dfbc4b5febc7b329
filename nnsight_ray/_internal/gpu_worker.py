"""nnsight's GPU worker plus the rank RPCs every nnsight_ray rank answers."""

from __future__ import annotations

from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

from .rank_worker import RankRPCMixin


class NNsightRayGPUWorker(RankRPCMixin, NNsightGPUWorker):
    """``NNsightGPUWorker`` that can also describe where it runs."""
