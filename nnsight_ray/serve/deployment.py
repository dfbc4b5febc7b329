"""The Serve edge: the replica that speaks nnsight-serve's protocol, and the registry.

Every Ray and Serve call of the package is made here; the request logic is in
``protocol.py``, the registered-block bookkeeping in ``registry.py``, the gate
in ``security.py``.

``NNsightDeployment`` (one per replica) owns one ``RayVLLM`` engine, TP x PP
ranks in a placement group of its own, named ``<app>-<replica id>`` in the
``nnsight_ray`` namespace. The engine starts in the background: the
constructor returns at once, so Serve marks the replica running and ``/health``
answers 503 until the engine is up (a constructor that waited would keep
the replica invisible instead, and ``serve run`` blocked, for the minute an
engine takes to start). Serve's ``check_health`` fails only once the engine
failed to start or died, so Serve replaces the replica then, and not while it
is still starting.

``NNsightRegistry`` (one replica per application, deleted with it) holds the
registered blocks and fans installs and clears out to every engine; each
replica attaches its engine to it (replaying what is recorded) before it
reports ready.
"""

# No `from __future__ import annotations` here: Serve pickles the deployment
# class by value, and cloudpickle keeps only the globals a function's code
# names, so FastAPI could no longer resolve string annotations such as
# "Request" and would treat `request` as a query parameter (422).
import asyncio
import logging
import threading
import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from ray import serve

from .config import ServeArgs
from .protocol import RETURN_SAVES_HEADER, CompletionRequest, build_trace, completion_response, trace_payload
from .registry import RegistrationError, Registry
from .security import GuardMiddleware

__all__ = ["NNsightDeployment", "NNsightRegistry"]

logger = logging.getLogger(__name__)

OCTET = "application/octet-stream"
# Names the engine (replica) that served a request: for operators and tests.
ENGINE_HEADER = "nnsight-engine"
HEALTH_TIMEOUT_S = 20.0


def _cause(error: BaseException) -> BaseException:
    """The exception an actor or replica raised, without Ray's wrapping."""
    import ray

    from ..ray_vllm import _unwrap

    cause = _unwrap(error)
    if isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None:
        return cause.cause
    return cause


def _engine_is_gone(error: BaseException) -> bool:
    import ray

    from ..errors import EngineDeadError

    error = _cause(error)
    return isinstance(error, (ray.exceptions.RayActorError, EngineDeadError)) or (
        isinstance(error, ValueError) and "Failed to look up actor" in str(error)
    )


@serve.deployment(name="NNsightRegistry", num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0})
class NNsightRegistry:
    """The application's registered blocks (see ``registry.Registry``), reached by handle."""

    def __init__(self) -> None:
        self.registry = Registry(self._rpc, _engine_is_gone)
        self._actors: dict[str, Any] = {}

    async def _rpc(self, engine: str, method: str, args: tuple) -> Any:
        import ray

        from .._internal.options import NAMESPACE

        actor = self._actors.get(engine)
        if actor is None:
            actor = self._actors[engine] = ray.get_actor(f"{engine}.engine", namespace=NAMESPACE)
        try:
            return await actor.rpc.remote(method, tuple(args))
        except Exception as error:
            if _engine_is_gone(error):
                self._actors.pop(engine, None)
            raise _cause(error) from None

    async def register(self, id: str, name: str | None, payload: bytes) -> dict[str, Any]:
        return await self.registry.register(id, name, payload)

    async def clear(self, id: str) -> dict[str, Any]:
        return await self.registry.clear(id)

    async def attach(self, engine: str) -> dict[str, Any]:
        return await self.registry.attach(engine)

    async def detach(self, engine: str) -> None:
        self._actors.pop(engine, None)
        await self.registry.detach(engine)

    async def status(self) -> dict[str, Any]:
        return self.registry.status()


def _http_error(status: int, detail: str) -> HTTPException:
    return HTTPException(status_code=status, detail=detail)


def _openai_error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


@serve.deployment(name="NNsightDeployment", max_ongoing_requests=256, graceful_shutdown_timeout_s=90,
                  health_check_period_s=10, health_check_timeout_s=30, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class NNsightDeployment:
    """One replica: one RayVLLM engine behind nnsight-serve's HTTP protocol.

    Args:
        args: the application's validated arguments.
        registry: handle of the application's ``NNsightRegistry``.
    """

    def __init__(self, args: ServeArgs, registry: Any) -> None:
        self.args = args
        self.api_key = args.resolved_api_key()
        self.registry = registry
        context = serve.get_replica_context()
        self.engine_name = f"{context.app_name or 'default'}-{context.replica_tag}"
        self.model: Any = None
        self.engine: Any = None
        self.persistent_objects: dict | None = None
        self.state = "starting"
        self.error: str | None = None
        self._closed = threading.Event()
        if self.api_key is None:
            logger.warning("replica %s: no API key set (api_key / NNSIGHT_RAY_API_KEY); every client that reaches "
                           "the route can run code on the cluster", self.engine_name)
        self._starting = asyncio.get_running_loop().create_task(self._start())

    # -- life cycle -----------------------------------------------------------

    def _build(self) -> Any:
        """Deploy this replica's engine (blocking: runs on a worker thread)."""
        from ..ray_vllm import RayVLLM

        model = RayVLLM(self.args.model, name=self.engine_name, **self.args.engine_options())
        if self._closed.is_set():  # the replica stopped while the engine started
            model.shutdown()
            raise RuntimeError("replica stopped while its engine was starting")
        return model

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            logger.info("replica %s: starting engine %s (tp=%d, pp=%d, %s)", self.engine_name, self.args.model,
                        self.args.tensor_parallel_size, self.args.pipeline_parallel_size, self.args.placement_strategy)
            model = await loop.run_in_executor(None, self._build)
            self.model, self.engine = model, model.vllm_entrypoint
            self.persistent_objects = model._remoteable_persistent_objects()
            replay = await self._attach()
            if replay["failed"]:
                logger.error("replica %s: replayed registrations failed: %s", self.engine_name, replay["failed"])
            self.state = "ready"
            logger.info("replica %s: engine ready (%d registrations replayed)", self.engine_name, replay["replayed"])
        except Exception as error:
            self.state, self.error = "failed", f"{type(error).__name__}: {_cause(error)}"
            logger.exception("replica %s: engine failed to start", self.engine_name)

    async def _attach(self, attempts: int = 5) -> dict[str, Any]:
        """Attach the engine to the registry (replaying its blocks); the registry may still be starting."""
        for attempt in range(attempts):
            try:
                return await self.registry.attach.remote(self.engine_name)
            except Exception as error:
                if attempt == attempts - 1 or _engine_is_gone(error):
                    raise
                logger.warning("replica %s: registry not reachable (%s); retrying", self.engine_name, _cause(error))
                await asyncio.sleep(2 ** attempt)
        raise AssertionError("unreachable")

    async def check_health(self) -> None:
        """Serve's probe: fail once the engine failed or died (Serve then replaces the replica)."""
        if self.state == "failed":
            raise RuntimeError(f"engine {self.engine_name} failed to start: {self.error}")
        if self.state == "dead":  # every check from now on: Serve replaces a replica after several
            raise RuntimeError(self.error)
        if self.state != "ready":
            return
        try:
            health = await asyncio.wait_for(self.engine.engine.health.remote(), HEALTH_TIMEOUT_S)
        except Exception as error:
            self.state, self.error = "dead", f"engine unreachable: {_cause(error)}"
            raise RuntimeError(self.error) from None
        if not health.get("alive", False):
            self.state, self.error = "dead", health.get("error") or "engine dead"
            raise RuntimeError(self.error)

    def __del__(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        model, self.model = getattr(self, "model", None), None
        if model is None:
            return
        try:
            self.registry.detach.remote(self.engine_name)
        except Exception:
            pass
        try:
            model.shutdown()
        except Exception:
            logger.warning("replica %s: engine shutdown failed", self.engine_name, exc_info=True)

    def _ready(self) -> None:
        if self.state != "ready":
            detail = {"starting": "Engine not ready (starting)"}.get(
                self.state, f"Engine not available ({self.state}): {self.error}")
            raise _http_error(503, detail)

    # -- routes ---------------------------------------------------------------

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="nnsight_ray serve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(GuardMiddleware, api_key=self.api_key, max_body_bytes=self.args.max_body_bytes)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/nnsight/generate", self.generate, methods=["POST"])
        app.add_api_route("/v1/nnsight/register/{registration_id}", self.register, methods=["POST"])
        app.add_api_route("/v1/nnsight/register/{registration_id}/clear", self.clear, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        return app

    async def health(self) -> dict[str, Any]:
        self._ready()
        return {"status": "ok", "engine": self.engine_name}

    async def generate(self, request: Request) -> Response:
        """Run a serialized trace; reply ``torch.save({"saves", "error"})`` (nnsight's wire format).

        The reply's ``Server-Timing`` header splits the time into the build
        (deserialize + prepare + attach, on this replica) and the engine
        (submit to merged result).
        """
        from nnsight.intervention.errors import capture_exception

        self._ready()
        body = await request.body()
        compress = request.headers.get("nnsight-compress", "False").lower() == "true"
        started = time.perf_counter()
        try:
            built = build_trace(self.model, body, self.persistent_objects, compress)
        except Exception as error:
            logger.info("replica %s: trace failed to build: %s", self.engine_name, error)
            return self._trace_reply({}, capture_exception(error), started, time.perf_counter())
        built_at = time.perf_counter()
        ref = self.engine.trace_ref(built.prompts, built.params, built.loras, built.presaved)
        try:
            saves, error = await ref, None
        except Exception as failure:
            cause = _cause(failure)
            logger.warning("replica %s: trace failed: %s", self.engine_name, cause)
            # An intervention's error keeps nnsight's wire form (its traceback points at the user's line).
            saves, error = {}, getattr(cause, "deferred", None) or capture_exception(cause)
        return self._trace_reply(saves, error, started, built_at)

    def _trace_reply(self, saves: dict, error: Any, started: float, built_at: float) -> Response:
        body = trace_payload(saves, error)
        now = time.perf_counter()
        timing = f"build;dur={(built_at - started) * 1e3:.1f}, engine;dur={(now - built_at) * 1e3:.1f}"
        return Response(body, media_type=OCTET, headers={ENGINE_HEADER: self.engine_name, "server-timing": timing})

    async def register(self, registration_id: str, request: Request, name: str | None = None) -> dict[str, Any]:
        """Install a block on every replica's engine (``model.edit(serve=url)``)."""
        self._ready()
        if self.args.engine_kwargs.get("enable_prefix_caching"):
            logger.warning("replica %s: prefix caching is on, so a registered block misses cached tokens",
                           self.engine_name)
        payload = await request.body()
        try:
            await self.registry.register.remote(registration_id, name, payload)
        except Exception as error:
            cause = _cause(error)
            status = 400 if isinstance(cause, RegistrationError) else 500
            raise _http_error(status, str(cause)) from None
        return {"status": "ok", "id": registration_id, "name": name}

    async def clear(self, registration_id: str) -> dict[str, Any]:
        """Remove a block from every engine; unknown ids are a no-op."""
        self._ready()
        try:
            await self.registry.clear.remote(registration_id)
        except Exception as error:
            raise _http_error(500, str(_cause(error))) from None
        return {"status": "ok", "id": registration_id}

    async def completions(self, request: Request) -> Response:
        """OpenAI-style completions through the same engine; registered blocks run on them."""
        from pydantic import ValidationError

        from ..errors import RequestError

        self._ready()
        body = await request.body()
        try:
            completion = CompletionRequest.model_validate_json(body)
            prompts, params = completion.prompts(), completion.sampling_params()
        except (ValidationError, ValueError) as error:
            return _openai_error(400, str(error))
        return_saves = completion.nnsight.return_saves or (
            request.headers.get(RETURN_SAVES_HEADER, "").lower() in ("1", "true", "yes"))
        try:
            outputs = await self.engine.generate_async(prompts, params)
        except Exception as error:
            cause = _cause(error)
            if isinstance(cause, (RequestError, ValueError, TypeError)):
                return _openai_error(400, str(cause))
            logger.exception("replica %s: completion failed", self.engine_name)
            return _openai_error(500, f"{type(cause).__name__}: {cause}", "server_error")
        return JSONResponse(completion_response(outputs, completion.model or self.args.model, return_saves),
                            headers={ENGINE_HEADER: self.engine_name})
