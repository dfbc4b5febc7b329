"""The Ray edge of a deployment: the engine and merge actors, launch / connect / shutdown.

``records`` says what a deployment is (spec, handles, inherited environment,
the GCS readers the watches use); ``actors`` holds the engine and merge actor
shells, whose logic lives in ``engine.core``, ``merge.book`` and
``cluster.liveness`` and never calls Ray itself; ``launch`` applies their
``ray.remote`` options (names, namespace, lifetime, resources, runtime env)
and starts, connects to and shuts down deployments. The rank actors' options
are applied by the executor vLLM's engine core runs (``ranks.executor``); the
rank placement group's owner is ``cluster.placement.RankReservation``.

Names, in the ``nnsight_ray`` namespace, for a deployment called ``<name>``::

    <name>.engine          EngineActor (the driver actor: vLLM's AsyncLLM)
    <name>.merge<i>        MergeActor shard i (requests are sharded by group id)
    <name>.pp<p>.tp<t>     rank actors (created by vLLM's engine core through
                           nnsight_ray's Ray executor)
"""

from .actors import EngineActor, MergeActor, probe_rank_platform
from .launch import connect, discard, launch, list_deployments, shutdown, wait_started
from .records import CLUSTER, Deployment, DeploymentSpec, alive_nodes, forwarded_env, gcs_actor_entry, merge_index

__all__ = ["CLUSTER", "Deployment", "DeploymentSpec", "EngineActor", "MergeActor", "alive_nodes", "connect",
           "discard", "forwarded_env", "gcs_actor_entry", "launch", "list_deployments", "merge_index",
           "probe_rank_platform", "shutdown", "wait_started"]
