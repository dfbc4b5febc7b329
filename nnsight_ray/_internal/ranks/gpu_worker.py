"""nnsight's GPU worker plus the rank RPCs every nnsight_ray rank answers.

The runner nnsight installs (``NNsightGPUModelRunner``) is replaced by a
subclass carrying ``pipeline``'s mixins, the same composition the CPU worker
uses, so a trace written against the whole model runs on every pipeline stage
on GPUs as on CPUs (see ``nnsight_ray._internal.pipeline``). At
``pipeline_parallel_size=1`` the mixins are inert.
"""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ..pipeline import StageForwardMixin
from .rpcs import RankRPCMixin
from .mixins import RUNNER_MIXINS


class NNsightStageGPUModelRunner(*RUNNER_MIXINS, NNsightGPUModelRunner, StageForwardMixin, GPUModelRunner):
    """nnsight's GPU runner, pipeline-stage aware (MRO as in ``NNsightCPUModelRunner``)."""


class NNsightRayGPUWorker(RankRPCMixin, NNsightGPUWorker):
    """``NNsightGPUWorker`` that can also describe where it runs, with the stage-aware runner."""

    def init_device(self) -> None:
        super().init_device()  # refuses any runner but GPUModelRunner, installs nnsight's
        self.model_runner.__class__ = NNsightStageGPUModelRunner
