"""RPC entry points every nnsight_ray rank answers, on any platform.

Mixed into the CPU and GPU worker classes (see ``platform.worker_cls``) so that
``collective_rpc("nnsight_ray_describe")`` reports, in rank order, where every
rank runs, whichever executor (Ray ranks or vLLM's multiprocessing) built it.
"""

from __future__ import annotations

import os
from typing import Any


class RankRPCMixin:
    """Describe this rank: its (pp, tp) coordinates and where Ray placed it."""

    def nnsight_ray_describe(self) -> dict[str, Any]:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        info: dict[str, Any] = {
            "rank": self.rank,
            "pp_rank": get_pp_group().rank_in_group,
            "tp_rank": get_tp_group().rank_in_group,
            "pid": os.getpid(),
            "node_id": None,
            "actor_name": None,
        }
        try:
            import ray

            if ray.is_initialized():
                ctx = ray.get_runtime_context()
                info["node_id"] = ctx.get_node_id()
                info["actor_name"] = ctx.get_actor_name()
        except Exception:  # not under Ray (multiprocessing executor)
            pass
        return info
