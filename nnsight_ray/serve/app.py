"""``build_app``: the application builder ``serve run`` and Serve configs import.

    serve run nnsight_ray.serve:build_app model=/path/to/checkpoint tensor_parallel_size=2
    serve run cluster_configs/serve.yaml

Builds one ``NNsightDeployment`` (``num_replicas`` replicas, each deploying its
own TP x PP engine, or all attached to one running deployment: ``engine=``),
the application's ``NNsightRegistry`` and its ``NNsightJobs`` (``remote=True``).
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import SecretStr

from .config import API_KEY_ENV, ServeArgs

__all__ = ["build_app"]


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The nnsight Serve application for ``args`` (see ``ServeArgs`` for the keys).

    Raises ``ServeArgsError`` before anything is deployed when an argument is
    unknown or out of range. The API key comes from ``args["api_key"]``, else
    ``$NNSIGHT_RAY_API_KEY`` where the builder runs, else (read at start-up)
    where each replica runs; without one, every route is open to whoever
    reaches the port, and the proxies bind 127.0.0.1 unless configured
    otherwise.
    """
    from .deployment import NNsightDeployment, NNsightRegistry
    from .job_store import NNsightJobs
    from .routing import router_config

    parsed = ServeArgs.parse(args)
    if parsed.api_key is None and os.environ.get(API_KEY_ENV):
        parsed = parsed.model_copy(update={"api_key": SecretStr(os.environ[API_KEY_ENV])})
    # Serve's power of two choices, except that a replica whose engine has stopped stepping goes last.
    deployment = NNsightDeployment.options(num_replicas=parsed.num_replicas,
                                           request_router_config=router_config(parsed.stalled_after_s))
    penalty = parsed.penalty(parsed.resolved_keys())  # 0 unless tenants have keys of their own
    return deployment.bind(parsed, NNsightRegistry.bind(), NNsightJobs.bind(parsed.job_limits(), penalty))
