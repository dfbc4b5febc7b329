"""Rank bundles and actor resources per device: pure logic, no Ray cluster."""

from __future__ import annotations

import pytest

from nnsight_ray._internal.cluster.placement import RankPlacement
from nnsight_ray._internal.ranks.executor import actor_resources


def test_cpu_bundles_reserve_cpus_only():
    placement = RankPlacement(device="cpu", cpus_per_rank=2)
    assert placement.bundles(3) == [{"CPU": 2.0}] * 3
    assert actor_resources(placement) == {"num_gpus": 0}


def test_gpu_bundles_reserve_one_accelerator_each():
    placement = RankPlacement(device="gpu", cpus_per_rank=1, gpus_per_rank=1)
    assert placement.bundles(2) == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert actor_resources(placement) == {"num_gpus": 1.0}


def test_other_accelerators_use_their_ray_resource_name():
    placement = RankPlacement(device="gpu", gpu_resource="TPU", gpus_per_rank=1)
    assert placement.bundles(1) == [{"CPU": 1.0, "TPU": 1.0}]
    assert actor_resources(placement) == {"num_gpus": 0, "resources": {"TPU": 1.0}}


def test_bad_device_and_strategy_are_refused():
    with pytest.raises(ValueError):
        RankPlacement(device="tpu")
    with pytest.raises(ValueError):
        RankPlacement(placement_strategy="RANDOM")


# -- multi-GPU by design (one GPU is lent; these layouts run on the x2/x4 hosts) --


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_every_rank_of_tp_and_pp_layouts_asks_for_one_gpu(tp, pp):
    placement = RankPlacement(device="gpu")
    bundles = placement.bundles(tp * pp)
    assert bundles == [{"CPU": 1.0, "GPU": 1.0}] * (tp * pp)
    assert actor_resources(placement)["num_gpus"] == 1.0


@pytest.mark.parametrize("placed", [
    [("n0", [0]), ("n0", [1])],                                   # TP=2 (or PP=2), one node
    [("n0", [3]), ("n0", [1]), ("n0", [0]), ("n0", [2])],         # TP=2 x PP=2, one node, ids out of order
    [("n0", [0]), ("n1", [0]), ("n0", [1]), ("n1", [1])],         # TP=2 x PP=2 over two nodes
])
def test_each_rank_sees_its_own_device(placed):
    from nnsight_ray._internal.ranks.executor import rank_devices

    plan = rank_devices(placed)
    devices = set()
    for (node, gpus), (local_rank, visible) in zip(placed, plan):
        node_gpus = sorted(g for n, gs in placed if n == node for g in gs)
        assert visible == node_gpus
        assert 0 <= local_rank < len(visible)
        devices.add((node, visible[local_rank]))
    assert len(devices) == len(placed)  # no two ranks on one physical device


def test_cpu_ranks_get_no_gpu_ids():
    from nnsight_ray._internal.ranks.executor import rank_devices

    assert rank_devices([("n0", []), ("n0", []), ("n1", [])]) == [(0, None), (1, None), (0, None)]



# -- which bundle each rank takes --


def test_ranks_take_the_bundles_in_order():
    from nnsight_ray._internal.ranks.executor import rank_bundles

    nodes = {0: "a", 1: "b", 2: "a", 3: "b"}
    assert rank_bundles(4, None, nodes) == [(0, "a"), (1, "b"), (2, "a"), (3, "b")]
    assert rank_bundles(2, "", nodes) == [(0, "a"), (1, "b")]


def test_vllm_bundle_indices_pick_each_ranks_bundle():
    from nnsight_ray._internal.ranks.executor import rank_bundles

    nodes = {0: "a", 1: "b", 2: "a", 3: "b"}
    assert rank_bundles(2, "3,0", nodes) == [(3, "b"), (0, "a")]


@pytest.mark.parametrize("indices,says", [
    ("0", "needs 2 distinct bundle indices"),
    ("1,1", "needs 2 distinct bundle indices"),
    ("0,x", "comma-separated integers"),
    ("0,7", "has no bundle [7]"),
])
def test_bad_vllm_bundle_indices_say_what_is_wrong(indices, says):
    from nnsight_ray._internal.ranks.executor import rank_bundles

    with pytest.raises(ValueError, match="VLLM_RAY_BUNDLE_INDICES") as error:
        rank_bundles(2, indices, {0: "a", 1: "b"})
    assert says in str(error.value)
