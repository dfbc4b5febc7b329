"""Ray's error wrapping taken off in one place (``_internal.ray_errors``), on Ray's real exception classes."""

from __future__ import annotations

import ray

from nnsight_ray._internal.cluster.ray_errors import call_errors, cause
from nnsight_ray.errors import EngineDeadError


def test_the_actors_own_exception_comes_out_of_nested_task_errors():
    raised = ValueError("bad prompt")
    once = ray.exceptions.RayTaskError("MergeActor.trace", "traceback", raised)
    twice = ray.exceptions.RayTaskError("Deployment.generate", "traceback", once)
    assert cause(once) is raised and cause(twice) is raised
    assert cause(raised) is raised  # not wrapped: as is
    assert isinstance(once, call_errors())


def test_a_dead_actor_is_an_engine_dead_error():
    died = ray.exceptions.RayActorError()
    error = cause(died)
    assert isinstance(error, EngineDeadError) and "actor died" in str(error)
    assert isinstance(died, call_errors())
