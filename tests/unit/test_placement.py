"""Rank bundles and actor resources per device: pure logic, no Ray cluster."""

from __future__ import annotations

import pytest

from nnsight_ray._internal.options import RankPlacement
from nnsight_ray._internal.options import _bundles
from nnsight_ray._internal.ray_executor import _actor_resources


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: (_ for _ in ()).throw(AssertionError("unit tests must not start Ray")))


def test_cpu_bundles_reserve_cpus_only():
    placement = RankPlacement(device="cpu", cpus_per_rank=2)
    assert _bundles(3, placement) == [{"CPU": 2.0}] * 3
    assert _actor_resources(placement) == {"num_cpus": 0, "num_gpus": 0}


def test_gpu_bundles_reserve_one_accelerator_each():
    placement = RankPlacement(device="gpu", cpus_per_rank=1, gpus_per_rank=1)
    assert _bundles(2, placement) == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert _actor_resources(placement) == {"num_cpus": 0, "num_gpus": 1.0}


def test_other_accelerators_use_their_ray_resource_name():
    placement = RankPlacement(device="gpu", gpu_resource="TPU", gpus_per_rank=1)
    assert _bundles(1, placement) == [{"CPU": 1.0, "TPU": 1.0}]
    assert _actor_resources(placement) == {"num_cpus": 0, "num_gpus": 0, "resources": {"TPU": 1.0}}


def test_bad_device_and_strategy_are_refused():
    with pytest.raises(ValueError):
        RankPlacement(device="tpu")
    with pytest.raises(ValueError):
        RankPlacement(placement_strategy="RANDOM")
