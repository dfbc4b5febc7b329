"""A rank actor dies mid-generation: pending requests fail fast, naming the rank and node."""

from __future__ import annotations

import time

import pytest
import ray

from conftest import ENGINE_KWARGS

pytestmark = pytest.mark.integration


def test_killed_rank_fails_pending_requests_and_engine_rebuilds(ray_cluster, model_dir):
    from nnsight_ray import RayVLLM
    from nnsight_ray.errors import EngineDeadError

    victim = RayVLLM(model_dir, name="victim", tensor_parallel_size=2, placement_strategy="STRICT_SPREAD",
                     **ENGINE_KWARGS)
    try:
        topology = victim.topology()
        dead = topology[1]
        with victim.trace("Hello world", temperature=0.0, max_tokens=200, ignore_eos=True,
                          blocking=False) as tracer:
            victim.model.layers[0].output[0].save()
        time.sleep(1.0)  # let it start generating
        ray.kill(ray.get_actor(dead["actor_name"], namespace="nnsight_ray"))
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            tracer.collect(timeout=90)
        assert time.monotonic() - started < 60
        message = str(info.value)
        assert dead["actor_name"] in message and dead["node_id"] in message
        assert victim.health()["alive"] is False
        # New requests fail at once with the same explanation, rather than hanging.
        with pytest.raises(EngineDeadError):
            with victim.trace("Hello", temperature=0.0, max_tokens=1):
                victim.model.layers[0].output[0].save()
    finally:
        victim.shutdown()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith("victim.")]

    rebuilt = RayVLLM(model_dir, name="victim", tensor_parallel_size=2, placement_strategy="STRICT_SPREAD",
                      **ENGINE_KWARGS)
    try:
        with rebuilt.trace("Hello", temperature=0.0, max_tokens=1):
            hidden = rebuilt.model.layers[0].output[0].save()
        assert hidden.shape[-1] == 128
        assert rebuilt.request_counts() == [0, 0]
    finally:
        rebuilt.shutdown()
