"""Launch, wait for, connect to and shut down a deployment: the ``ray.remote`` options of its actors, in one place.

The rank actors' options are applied by the executor vLLM's engine core runs
(``ranks.executor``); the rank placement group's owner is
``cluster.placement.RankReservation``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from ...errors import RequestError
from ..blocks import graphs
from ..cluster.placement import (NAMESPACE, RankPlacement, RankReservation, placement_group_name, plan_placement,
                                 world_size)
from ..cluster.ray_errors import cause
from ..cluster.topology import RankId
from ..ranks.limits import engine_limits
from .actors import EngineActor, MergeActor
from .records import Deployment, DeploymentSpec, forwarded_env

logger = logging.getLogger(__name__)

def launch(name: str, model: str, engine_kwargs: dict[str, Any], placement: RankPlacement,
           num_merge_actors: int = 1, detached: bool = False,
           engine_actor_options: dict[str, Any] | None = None, usage_context: str = "LLM_CLASS") -> Deployment:
    """Plan the ranks' placement (reserving their group), create the merge and engine actors, start the engine; don't wait.

    Returns the deployment with its pending start; ``wait_started`` waits for
    it (and cleans up if it failed). Meanwhile the caller can build its
    client, or launch other deployments: an engine start is mostly waiting
    for processes to come up and import vLLM, so several overlap well.

    ``engine_actor_options`` are extra ``.options()`` for the engine actor, e.g.
    ``{"resources": {"gpu_node": 0.01}}`` to keep vLLM's engine core off a
    CPU-only head node of a GPU cluster (docs/clusters.md).
    """
    from ..engine.parity import usage_context as checked_context

    usage_context = checked_context(usage_context)
    placement = placement.model_copy(update={"engine_name": name})
    graphs.engine_mode(engine_kwargs)  # refuses a contradictory enforce_eager / taps here, in the caller
    engine_limits(engine_kwargs)  # and limits on blocks that make no sense
    lifetime = "detached" if detached else None
    merge_names = tuple(f"{name}.merge{i}" for i in range(num_merge_actors))
    for actor_name in [f"{name}.engine", *merge_names]:
        try:
            ray.get_actor(actor_name, namespace=NAMESPACE)
        except ValueError:
            continue
        raise RequestError(
            f"a deployment named {name!r} already runs in namespace {NAMESPACE!r} ({actor_name}); "
            f"attach with RayVLLM.connect({name!r}), shut it down, or pick another name."
        )
    # Reserved here, before any actor starts: an unsatisfiable layout fails in
    # seconds with what the cluster has, not after an engine actor has loaded
    # vLLM. Released at shutdown (`RankReservation.release`: by the executor,
    # and by shutdown()); a non-detached one also by Ray, with this process. A
    # group of this name with no deployment left (a detached one whose actors
    # were killed) is reclaimed.
    if placement.placement_group_id is None and RankReservation.reclaim(placement_group_name(name)):
        logger.warning("deployment %s: removed a rank placement group its previous deployment left", name)
    plan = plan_placement(placement, world_size(engine_kwargs), detached=detached)
    runtime_env = {"env_vars": forwarded_env()}
    merges = [
        ray.remote(MergeActor).options(name=n, namespace=NAMESPACE, lifetime=lifetime, num_cpus=0,
                                       runtime_env=runtime_env).remote(n)
        for n in merge_names
    ]
    spec = DeploymentSpec(name=name, model=model, engine_kwargs=engine_kwargs, placement=plan,
                          merge_names=merge_names, detached=detached, usage_context=usage_context)
    options = {"num_cpus": 0, "runtime_env": runtime_env, "max_concurrency": 10_000,
               **(engine_actor_options or {})}
    engine = ray.remote(EngineActor).options(
        name=spec.engine_name, namespace=NAMESPACE, lifetime=lifetime, **options,
    ).remote(spec)
    return Deployment(engine, merges, spec, starting=engine.start.remote())


def wait_started(deployment: Deployment, timeout_s: float = 600.0) -> Deployment:
    """Wait for a ``launch``ed engine to come up; on failure remove all of it and raise the engine's error."""
    starting, deployment.starting = deployment.starting, None
    if starting is None:
        return deployment
    try:
        ray.get(starting, timeout=timeout_s)
    except BaseException as error:
        for actor in [deployment.engine, *deployment.merges]:
            ray.kill(actor)
        RankReservation.of(deployment.spec.placement).release()
        if isinstance(error, ray.exceptions.RayTaskError):
            raise cause(error) from None
        raise
    return deployment


def discard(deployment: Deployment) -> None:
    """Take down a ``launch``ed deployment that will not be used (its start may still be under way)."""
    if deployment.starting is None:
        shutdown(deployment)
        return
    try:
        wait_started(deployment)  # a half-started engine cannot be stopped cleanly
    except Exception:
        return  # its start failed, and wait_started removed what it had
    shutdown(deployment)


def connect(name: str) -> Deployment:
    """A running named deployment, from any process in the cluster."""
    try:
        engine = ray.get_actor(f"{name}.engine", namespace=NAMESPACE)
    except ValueError:
        raise RequestError(
            f"no deployment named {name!r} in namespace {NAMESPACE!r}; running ones: "
            f"{sorted(list_deployments())}"
        ) from None
    spec: DeploymentSpec = ray.get(engine.config.remote())
    merges = [ray.get_actor(n, namespace=NAMESPACE) for n in spec.merge_names]
    return Deployment(engine, merges, spec)


def list_deployments() -> list[str]:
    from ray.util import list_named_actors

    return [a["name"][: -len(".engine")] for a in list_named_actors(all_namespaces=True)
            if a.get("namespace") == NAMESPACE and a["name"].endswith(".engine")]


def shutdown(deployment: Deployment, timeout_s: float = 60.0) -> None:
    """Stop the engine (its engine core removes the rank actors and placement group), then the actors."""
    engine, name = deployment.engine, deployment.name
    try:
        ray.get(engine.shutdown.remote(), timeout=timeout_s)
    except Exception:
        logger.warning("engine %s did not shut down cleanly; killing it", name, exc_info=True)
    for actor in [engine, *deployment.merges]:
        try:
            ray.kill(actor)
        except Exception:
            pass
    # Rank actors belong to the engine core's Ray job and die with it; make sure.
    deadline = time.monotonic() + timeout_s
    for rank in _rank_names(name):
        try:
            actor = ray.get_actor(rank, namespace=NAMESPACE)
        except ValueError:
            continue
        ray.kill(actor)
    while _rank_names(name) and time.monotonic() < deadline:
        time.sleep(0.5)
    # Reserved by launch(), so released here too: vLLM often stops its engine-core
    # process before the executor's own shutdown would release it (routine, not a fault).
    if RankReservation.of(deployment.spec.placement).release():
        logger.info("engine %s: removed its rank placement group", name)


def _rank_names(name: str) -> list[str]:
    from ray.util import list_named_actors

    names = []
    for actor in list_named_actors(all_namespaces=True):
        if actor.get("namespace") != NAMESPACE:
            continue
        try:
            if RankId.from_actor_name(actor["name"]).engine == name:
                names.append(actor["name"])
        except ValueError:
            continue
    return names
