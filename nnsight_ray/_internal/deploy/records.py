"""What a deployment is and how it is found: its spec and handles, the environment it inherits, the GCS readers.

Pure records and the few reads of Ray's global state that the watches need
(passed to them as ``CLUSTER``, so ``cluster.liveness`` never calls Ray).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any

import ray

from ..cluster.liveness import Cluster, last_words_key
from ..cluster.placement import NAMESPACE, PlacementPlan


# Environment the engine actor (and the engine-core process and ranks it
# starts) inherits from the deploying process: a raylet's workers otherwise
# see the raylet's environment, not the caller's.
_FORWARDED_ENV_PREFIXES = ("VLLM_", "NNSIGHT", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")

# Per-node settings: forwarding them would make a remote node advertise this one's.
_NODE_LOCAL_ENV = {"VLLM_HOST_IP", "VLLM_PORT", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "OMP_PLACES"}


def forwarded_env() -> dict[str, str]:
    from ..engine.platform import engine_env

    return {**engine_env(), **{k: v for k, v in os.environ.items()
                               if k.startswith(_FORWARDED_ENV_PREFIXES) and k not in _NODE_LOCAL_ENV}}


def merge_index(group: str, shards: int) -> int:
    """Which merge shard serves a group: stable across processes (not Python's hash)."""
    return zlib.crc32(group.encode()) % shards


def gcs_actor_entry(actor_id: str) -> dict[str, Any] | None:
    """The GCS actor-table entry of one actor (blocking), or None if it has none.

    Ray's private ``ray._private.state.actors`` (Ray 2.60.0), kept on purpose:
    the public ``ray.util.state.get_actor`` asks the dashboard's state API
    (clusters started by ``placement.connect_ray`` run without a dashboard) and
    its ``ActorState`` carries no end time, which is what tells the first rank
    to die from the ones vLLM stopped after it (``liveness.first_dead``).
    """
    import ray._private.state as ray_state

    entry = ray_state.actors(actor_id=actor_id) or None
    if entry and entry.get("State") == "DEAD":
        # A rank that stopped itself on purpose (a block stuck past its grace: ranks/limits.py) left its reason.
        from ray.experimental import internal_kv

        words = internal_kv._internal_kv_get(last_words_key(actor_id), namespace=NAMESPACE)
        if words:
            entry = {**entry, "LastWords": words.decode(errors="replace")}
    return entry


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


#: How the watches read this cluster (``liveness.Cluster``).
CLUSTER = Cluster(gcs_actor_entry, alive_nodes)


@dataclass(frozen=True)
class DeploymentSpec:
    """What a deployment is: the engine actor's construction argument, and what ``connect`` reads back."""

    name: str
    model: str
    engine_kwargs: dict[str, Any]
    placement: PlacementPlan
    merge_names: tuple[str, ...]
    detached: bool = False
    # Whose defaults the engine resolves: vllm.LLM's ("LLM_CLASS") or its OpenAI server's (parity.py).
    usage_context: str = "LLM_CLASS"

    @property
    def engine_name(self) -> str:
        return f"{self.name}.engine"


@dataclass
class Deployment:
    """A deployment's actor handles and spec; ``starting`` is the engine's pending start until ``wait_started``."""

    engine: Any
    merges: list[Any]
    spec: DeploymentSpec
    starting: Any = None

    @property
    def name(self) -> str:
        return self.spec.name

