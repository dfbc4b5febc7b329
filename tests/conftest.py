"""Shared fixtures: tiny checkpoints, one Ray cluster per session, engine helpers.

Engines cost ~30 s to start, so integration tests share them per module or
session. Every Ray process binds 127.0.0.1.
"""

from __future__ import annotations

import os

# Before `ray` is imported anywhere: keep every raylet and driver on loopback
# (see docs/platform.md, "Ray on one machine").
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny seeded Llama checkpoint (4 layers, hidden 128, 2 heads of 64)."""
    from nnsight_ray.models import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0))


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    """A tiny seeded GPT-2 checkpoint: a second module tree (transformer.h[i])."""
    from nnsight_ray.models import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny-gpt2"), arch="gpt2", seed=0))


@pytest.fixture(scope="session")
def ray_cluster():
    """A three-raylet Ray cluster on 127.0.0.1: head (1 CPU) + two 2-CPU "nodes".

    The driver (this pytest process) is connected in the ``nnsight_ray``
    namespace for the whole session.
    """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="nnsight_ray")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def request_counts(model) -> list[int]:
    """``nnsight_request_count`` on every rank of a LocalVLLM engine."""
    return model.vllm_entrypoint.collective_rpc("nnsight_request_count")
