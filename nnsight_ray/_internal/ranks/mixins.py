"""The behaviour nnsight_ray adds to nnsight's model runner, on every platform.

One tuple, so the CPU and GPU runners (``cpu_worker``, ``gpu_worker``) are
composed the same way: each mixin wraps nnsight's ``NNsightGPUModelRunner``
methods and calls ``super()``; ``StageForwardMixin`` (not here) sits below
nnsight's runner, around vLLM's load and forward.

- ``PackedCollectRunnerMixin``: collected values are pickled one buffer per dtype, not ``torch.save``
  per tensor (``payload``); first, so every collect below it, the pipeline stage's included, packs.
- ``LimitsRunnerMixin``: the engine's limits on each request's block (time) and saves (bytes) (``limits``); inside
  ``PackedCollectRunnerMixin``'s serializer choice, above the pipeline stage's collect, so every stage's saves are bounded.
- ``StageRunnerMixin``: pipeline stages (``pipeline``); inert at PP=1.
- ``BlockNamesRunnerMixin``: a unique source name per received block (``block_names``).
- ``SnapshotRunnerMixin``: saved values are snapshots, not views a later kernel overwrites (``snapshot``).
- ``EnvoyRefsRunnerMixin``: requests name the rank's envoys instead of carrying a tree (``envoy_refs``).
- ``ExtractRunnerMixin``: requests that ask for extraction have their rows written by the rank (``extract``).
- ``GraphStepsRunnerMixin``: on a graph engine, CUDA graphs on every step no block needs (``graphs``);
  last, so the taps it resolves are in place before the others look at the interleaver.
"""

from __future__ import annotations

from ..blocks.block_names import BlockNamesRunnerMixin
from ..blocks.envoy_refs import EnvoyRefsRunnerMixin
from ..extract.capture import ExtractRunnerMixin
from ..blocks.graphs import GraphStepsRunnerMixin
from ..merge.payload import PackedCollectRunnerMixin
from ..pipeline import StageRunnerMixin
from ..blocks.snapshot import SnapshotRunnerMixin
from .limits import LimitsRunnerMixin

RUNNER_MIXINS = (PackedCollectRunnerMixin, LimitsRunnerMixin, StageRunnerMixin, BlockNamesRunnerMixin, SnapshotRunnerMixin, EnvoyRefsRunnerMixin,
                 ExtractRunnerMixin, GraphStepsRunnerMixin)
