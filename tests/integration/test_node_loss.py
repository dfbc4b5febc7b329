"""A whole node lost under a TP=2 deployment: every waiter gets out within 10 s (issue 12, item 1).

A raylet killed with SIGKILL (``LocalCluster.remove_node(node,
allow_graceful=False)``) is what a lost machine looks like to the rest of the
cluster: nobody tells the GCS, which learns of it only from its health checks
(``local_cluster.HEALTH_CHECK``: 2.3-2.9 s here, 13 s with Ray's defaults, measured). The GCS
then marks the node's actors dead, the engine actor's watch sees its rank
dead, and every waiter gets the one death message, naming the rank actor and
that its node was removed.

The deployment runs on two raylets of its own, added for this test, so the
session engines are never on the lost node: each rank asks for 5 CPUs
(``cpus_per_rank=5``), which only these two 5-CPU raylets have (the session's
nodes have 4, the head 2), and STRICT_SPREAD puts one rank on each. The
engine actor is pinned to the driver's raylet (the head).
"""

from __future__ import annotations

import time

import pytest
import ray

from conftest import ENGINE_KWARGS
from test_layouts import assert_dead_everywhere, assert_every_waiter_fails, nothing_left, start_waiters

pytestmark = pytest.mark.integration

RANK_CPUS = 5


def test_lost_node_fails_every_waiter_within_10s(ray_cluster, model_dir):
    """TP=2 STRICT_SPREAD, a rank's raylet SIGKILLed with a blocking trace, a non-blocking ref, an
    async stream and a plain generate in flight: each fails within 10 s naming the rank actor and that its
    node is gone; a later call fails at once the same way; health() says so; shutdown leaves nothing.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from nnsight_ray import RayVLLM

    name = "nodeloss"
    nodes = [ray_cluster.add_node(num_cpus=RANK_CPUS) for _ in range(2)]
    ours = {node.node_id: node for node in nodes}
    head = ray.get_runtime_context().get_node_id()
    model = None
    try:
        model = RayVLLM(model_dir, name=name, tensor_parallel_size=2, placement_strategy="STRICT_SPREAD",
                        cpus_per_rank=RANK_CPUS, **ENGINE_KWARGS,
                        engine_actor_options={"scheduling_strategy": NodeAffinitySchedulingStrategy(head, soft=False)})
        topology = model.topology()
        assert {t["node_id"] for t in topology} == set(ours), (topology, list(ours))
        # Only the rank may live on the lost node: a merge actor there (it asks for no CPU, so
        # Ray may put it on either new raylet) would be blamed as well. Lose the rank whose node has none.
        others = {a["name"]: a["node_id"] for a in model.health()["actors"] if a["role"] != "rank"}
        (dead, *_) = [t for t in topology if t["node_id"] not in others.values()]

        streamer = RayVLLM.connect(name, mode="async")
        waiters = start_waiters(model, streamer)
        lost_at = time.monotonic()
        ray_cluster.remove_node(ours.pop(dead["node_id"]), allow_graceful=False)
        # The cause in brackets is the GCS's: "its node has died", or `ray.kill` when vLLM's executor
        # stopped the rank before the GCS found its node gone; the rank and its node are named either way.
        message = assert_every_waiter_fails(waiters, lost_at, dead["actor_name"], dead["node_id"],
                                            "(node removed)")
        took = {kind: round(outcome[2] - lost_at, 1) for kind, outcome in waiters["outcomes"].items()}
        print(f"\nnode lost; each waiter failed after (s): {took}\n{message}")
        assert_dead_everywhere(model, message, dead["actor_name"])
    finally:
        if model is not None:
            model.shutdown()
        for node in ours.values():
            ray_cluster.remove_node(node)
    nothing_left(name)
