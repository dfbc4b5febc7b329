"""nnsight's ``serve=`` protocol as a Ray Serve application over RayVLLM engines.

``build_app(args)`` returns the application (``serve run
nnsight_ray.serve:build_app model=...`` or a Serve config's ``import_path``).
Each replica owns one TP x PP engine; an unmodified nnsight client talks to it
with ``model.trace(..., serve=url)`` and ``model.edit(serve=url)``, and plain
OpenAI clients with ``/v1/completions``, ``/v1/chat/completions`` (streamed
too) and ``/v1/models``; nnsight's ``remote=True`` (NDIF's protocol:
``/request``, ``/subscribe``, ``/response``) reaches the same engines. See
``docs/serve.md`` and ``docs/metrics.md``.

A trace is code: whoever can reach the route and holds the API key runs Python
on the cluster.
"""

from __future__ import annotations

from .app import build_app
from .config import ServeArgs, ServeArgsError
from .protocol import decode_saves

__all__ = ["ServeArgs", "ServeArgsError", "build_app", "decode_saves"]
