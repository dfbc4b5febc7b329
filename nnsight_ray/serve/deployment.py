"""The Serve edge: the replica that speaks nnsight-serve's protocol, and the registry.

Every Ray and Serve call of the package is made here and in ``job_store.py``;
the request logic is in ``protocol.py`` and ``remote.py`` (``remote=True``),
the registered-block bookkeeping in ``registry.py``, the jobs in ``jobs.py``,
the gate in ``security.py``.

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
import gc
import logging
import threading
import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from .._internal.observe import metrics
from .config import ServeArgs
from .metering import MetricsMiddleware
from .openai_api import (SSE_DONE, ChatRequest, StreamChunks, chat_prompt, chat_response, error_body, models_list,
                         sse, validation_message)
from .protocol import (RETURN_SAVES_HEADER, CompletionRequest, build_trace, completion_response, error_of,
                       trace_payload)
from .job_store import JobsClient, TenantsClient
from .registry import RegistrationError, Registry
from .remote import ModelKeys, RemoteRoutes
from .routing import routing_stats
from .security import GuardMiddleware, tenant

__all__ = ["NNsightDeployment", "NNsightRegistry"]

logger = logging.getLogger(__name__)

OCTET = "application/octet-stream"
# Names the engine (replica) that served a request: for operators and tests.
ENGINE_HEADER = "nnsight-engine"
HEALTH_TIMEOUT_S = 20.0


def _cause(error: BaseException) -> BaseException:
    """The exception an actor or replica raised, without Ray's wrapping."""
    from .._internal.cluster.ray_errors import cause

    return cause(error)


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

        from .._internal.cluster.placement import NAMESPACE

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


def _openai_error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                  **headers: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, kind, param), headers=headers)


@serve.deployment(name="NNsightDeployment", max_ongoing_requests=256, graceful_shutdown_timeout_s=90,
                  health_check_period_s=10, health_check_timeout_s=30, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class NNsightDeployment:
    """One replica: one RayVLLM engine behind nnsight-serve's HTTP protocol.

    Args:
        args: the application's validated arguments.
        registry: handle of the application's ``NNsightRegistry``.
        jobs: handle of the application's ``NNsightJobs`` (``remote=True``).
    """

    def __init__(self, args: ServeArgs, registry: Any, jobs: Any) -> None:
        self.args = args
        self.api_key = args.resolved_keys()  # {tenant: key}, None: open
        self.tenants = TenantsClient(jobs, on=bool(args.penalty(self.api_key)))
        self.registry = registry
        context = serve.get_replica_context()
        self.name = f"{context.app_name or 'default'}-{context.replica_tag}"
        # An attached engine (engine=) is shared by every replica and outlives them.
        self.engine_name = args.engine or self.name
        self.jobs, self.limits, self.public_url = JobsClient(jobs), args.job_limits(), args.public_url
        self.model: Any = None
        self.engine: Any = None
        self.persistent_objects: dict | None = None
        self.state = "starting"
        self.error: str | None = None
        self._closed = threading.Event()
        if self.api_key is None:
            logger.warning("replica %s: no API key set (api_key / NNSIGHT_RAY_API_KEY); every client that reaches "
                           "the route can run code on the cluster", self.engine_name)
        if args.runaway_penalty and not self.tenants.on:
            logger.info("replica %s: runaway_penalty is off: tenants are told apart only by keys of their own "
                        "(api_keys)", self.engine_name)
        self._starting = asyncio.get_running_loop().create_task(self._start())

    # -- life cycle -----------------------------------------------------------

    def _build(self) -> Any:
        """Deploy this replica's engine (blocking: runs on a worker thread)."""
        from ..ray_vllm import RayVLLM

        if self.args.engine:
            model = RayVLLM.connect(self.args.engine)
        else:
            model = RayVLLM(self.args.model, name=self.engine_name, **self.args.engine_options())
            if self._closed.is_set():  # the replica stopped while the engine started
                model.shutdown()
                raise RuntimeError("replica stopped while its engine was starting")
        # What vLLM's own API server does once it is up: the startup heap (torch, vLLM, nnsight, Ray, the
        # engine's client) goes to a generation the collector never scans again. A replica hands every
        # request's saved values on; without this, when they pushed a full collection, it scanned the
        # whole heap with the event loop stopped (~0.35 s on the 2-core machine, caller gc in python -m benchmarks.gpu).
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
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
            # Its engine actor is gone, so the engine could not count its own death.
            metrics.inc("nnsight_engine_deaths", deployment=self.engine_name)
            raise RuntimeError(self.error) from None
        if not health.get("alive", False):
            self.state, self.error = "dead", health.get("error") or "engine dead"
            raise RuntimeError(self.error)

    def __del__(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        model, self.model = getattr(self, "model", None), None
        if model is None or self.args.engine:  # an attached engine is not this replica's to stop
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
        # Added last, so outermost: a refused request never reaches the metrics.
        app.add_middleware(MetricsMiddleware, replica=self.engine_name)
        app.add_middleware(GuardMiddleware, api_key=self.api_key, max_body_bytes=self.args.max_body_bytes)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/nnsight/generate", self.generate, methods=["POST"])
        app.add_api_route("/v1/nnsight/register/{registration_id}", self.register, methods=["POST"])
        app.add_api_route("/v1/nnsight/register/{registration_id}/clear", self.clear, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        RemoteRoutes(self, ModelKeys(self.args.model_names())).mount(app)
        return app

    def ready(self) -> None:
        self._ready()

    def job_ended(self, saved_bytes: int, error_type: str | None) -> None:
        """Count a ``remote=True`` job's result bytes or its error (route ``remote``)."""
        metrics.inc("nnsight_saved_bytes", saved_bytes, route="remote")
        if error_type is not None:
            metrics.inc("nnsight_intervention_errors", route="remote", type=error_type)

    async def run_trace(self, built: Any) -> dict[str, Any]:
        """Submit a built trace to this replica's engine; its merged saves (the trace's error, unwrapped)."""
        try:
            return await self.engine.trace_ref(built.prompts, built.params, built.loras, built.presaved)
        except Exception as error:
            raise _cause(error) from None

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing-stats seam: how long this replica's engine has gone without a step (``routing.py``)."""
        return await routing_stats(self.state, self.engine and self.engine.engine)

    async def health(self) -> dict[str, Any]:
        self._ready()
        return {"status": "ok", "engine": self.engine_name, "gc_frozen": gc.get_freeze_count()}

    async def generate(self, request: Request) -> Response:
        """Run a serialized trace; reply ``torch.save({"saves", "error"})`` (nnsight's wire format).

        The reply's ``Server-Timing`` header splits the time into the build
        (deserialize + prepare + attach, on this replica) and the engine
        (submit to merged result).
        """
        from nnsight.intervention.errors import capture_exception

        self._ready()
        who = tenant(request.scope)
        refusal, tracked = await self.tenants.admit(who)
        if refusal is not None:
            return JSONResponse({"detail": refusal.detail}, status_code=429, headers=refusal.headers())
        error = None
        try:
            body = await request.body()
            compress = request.headers.get("nnsight-compress", "False").lower() == "true"
            started = time.perf_counter()
            try:
                built = build_trace(self.model, body, self.persistent_objects, compress)
            except Exception as failure:
                logger.info("replica %s: trace failed to build: %s", self.engine_name, failure)
                return self._trace_reply({}, capture_exception(failure), started, time.perf_counter())
            built_at = time.perf_counter()
            try:
                saves = await self.engine.trace_ref(built.prompts, built.params, built.loras, built.presaved)
            except Exception as failure:
                cause = _cause(failure)
                logger.warning("replica %s: trace failed: %s", self.engine_name, cause)
                # An intervention's error keeps nnsight's wire form (its traceback points at the user's line).
                saves, error = {}, getattr(cause, "deferred", None) or capture_exception(cause)
            return self._trace_reply(saves, error, started, built_at)
        finally:  # a stopped block starts its tenant's cool-down; a probation slot is given back
            await asyncio.shield(self.tenants.end(who, error, tracked))

    def _trace_reply(self, saves: dict, error: Any, started: float, built_at: float) -> Response:
        body = trace_payload(saves, error)
        metrics.inc("nnsight_saved_bytes", len(body), route="generate")
        if error is not None and not error.get("is_control_flow"):
            metrics.inc("nnsight_intervention_errors", route="generate", type=error.get("type_name"))
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

    # -- OpenAI routes ----------------------------------------------------------

    def _openai_not_ready(self) -> JSONResponse | None:
        try:
            self._ready()
        except HTTPException as error:
            return _openai_error(error.status_code, error.detail, "service_unavailable")
        return None

    async def _parse(self, request: Request, model: type) -> Any:
        """The body as ``model``, or the 400 saying what is wrong with it."""
        from pydantic import ValidationError

        try:
            return model.model_validate_json(await request.body())
        except (ValidationError, ValueError) as error:
            return _openai_error(400, validation_message(error))

    async def _unknown_edits(self, edits: list[str] | None) -> JSONResponse | None:
        """400 if the request names an edit no registration carries (names are registry-wide)."""
        if edits is None:
            return None
        status = await self.registry.status.remote()
        names = sorted({r["name"] for r in status["registrations"] if r["name"] is not None})
        unknown = [name for name in edits if name not in names]
        if not unknown:
            return None
        return _openai_error(
            400, f"nnsight.edits names {unknown}, but no edit is registered under "
            f"{'that name' if len(unknown) == 1 else 'those names'} (registered: {names}); register it with "
            "model.edit(name=..., serve=url), or drop it from the list", param="nnsight.edits")

    def _return_saves(self, options: Any, request: Request) -> bool:
        return options.wants_saves or request.headers.get(RETURN_SAVES_HEADER, "").lower() in ("1", "true", "yes")

    def _engine_failure(self, error: BaseException, route: str) -> JSONResponse:
        from ..errors import RequestError

        cause = _cause(error)
        if isinstance(cause, (RequestError, ValueError, TypeError)):
            return _openai_error(400, str(cause), **{ENGINE_HEADER: self.engine_name})
        logger.exception("replica %s: %s failed", self.engine_name, route, exc_info=cause)
        return _openai_error(500, f"{type(cause).__name__}: {cause}", "server_error", **{ENGINE_HEADER: self.engine_name})

    def _count_outputs(self, outputs: list[Any], route: str, reply: dict[str, Any]) -> None:
        for output in outputs:
            _, kind = error_of(output)
            if kind is not None:
                metrics.inc("nnsight_intervention_errors", route=route, type=kind)
        if "nnsight_saves" in reply:
            metrics.inc("nnsight_saved_bytes", len(reply["nnsight_saves"]), route=route)

    async def _generate(self, prompts: list, params: Any, route: str, respond: Any) -> Response:
        try:
            outputs = await self.engine.generate_async(prompts, params)
        except Exception as error:
            return self._engine_failure(error, route)
        reply = respond(outputs)
        self._count_outputs(outputs, route, reply)
        return JSONResponse(reply, headers={ENGINE_HEADER: self.engine_name})

    async def completions(self, request: Request) -> Response:
        """OpenAI completions (``stream`` too) through the same engine; registered blocks run on them."""
        return await self._openai(request, CompletionRequest, "completion", self._completion_inputs)

    async def chat_completions(self, request: Request) -> Response:
        """OpenAI chat completions (``stream`` too): the checkpoint's chat template, then the same engine."""
        return await self._openai(request, ChatRequest, "chat", self._chat_inputs)

    async def _completion_inputs(self, completion: CompletionRequest) -> tuple[list, Any]:
        return completion.prompts(), completion.sampling_params()

    async def _chat_inputs(self, chat: ChatRequest) -> tuple[list, Any]:
        prompt, params = chat_prompt(chat, await self._model_config(), self.model.tokenizer)
        return [prompt], params

    async def _openai(self, request: Request, model: type, kind: str, inputs: Any) -> Response:
        """One OpenAI request: parse, build the engine requests, check the edit names, then answer or stream.

        Every refusal is a 400 in OpenAI's error shape, before the engine sees anything.
        """
        from vllm.exceptions import VLLMClientError

        refusal = self._openai_not_ready()
        if refusal is not None:
            return refusal
        body = await self._parse(request, model)
        if isinstance(body, Response):
            return body
        try:
            prompts, params = await inputs(body)
        except (ValueError, TypeError, VLLMClientError) as error:
            return _openai_error(400, str(error))
        except Exception as error:
            logger.exception("replica %s: could not prepare a %s request", self.engine_name, kind)
            return _openai_error(500, f"{type(error).__name__}: {error}", "server_error")
        refusal = await self._unknown_edits(body.nnsight.edits)
        if refusal is not None:
            return refusal
        return_saves = self._return_saves(body.nnsight, request)
        name = body.model or self.args.model
        route = "chat" if kind == "chat" else "completions"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self._stream(StreamChunks(kind, name, len(prompts)), route, prompts,
                                      [params] * len(prompts), include_usage, return_saves)
        respond = chat_response if kind == "chat" else completion_response
        return await self._generate(prompts, params, route, lambda outputs: respond(outputs, name, return_saves))

    async def models(self) -> dict[str, Any]:
        """``/v1/models``: the checkpoint this application serves (any ``model`` name is accepted)."""
        return models_list(self.args.model, self.args.engine_kwargs.get("max_model_len"))

    async def _model_config(self) -> Any:
        """vLLM's ``ModelConfig`` of the checkpoint (chat templates need it), built once, off the event loop."""
        if getattr(self, "_chat_model_config", None) is None:
            self._chat_model_config = await asyncio.get_running_loop().run_in_executor(None, self._build_model_config)
        return self._chat_model_config

    def _build_model_config(self) -> Any:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        known = {f.name for f in dataclasses.fields(EngineArgs)}
        kwargs = {k: v for k, v in self.args.engine_kwargs.items() if k in known}
        return EngineArgs(model=self.args.model, **kwargs).create_model_config()

    # -- streams ----------------------------------------------------------------

    async def _stream(self, chunks: StreamChunks, route: str, prompts: list, params: list, include_usage: bool,
                      return_saves: bool) -> Response:
        """Start one engine stream per prompt; answer with their server-sent events.

        The first event is awaited before the reply starts, so a request the
        engine refuses at once (a prompt longer than the context) gets a plain
        400 rather than a stream that says so.
        """
        began = time.perf_counter()
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(i, prompt, param, queue))
                 for i, (prompt, param) in enumerate(zip(prompts, params))]
        first = await queue.get()
        if first[0] == "error":
            for pump in pumps:
                pump.cancel()
            return self._engine_failure(first[2], route)
        events = self._events(chunks, route, pumps, queue, first, began, include_usage, return_saves)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={ENGINE_HEADER: self.engine_name, "cache-control": "no-cache"})

    async def _pump(self, index: int, prompt: Any, param: Any, queue: asyncio.Queue) -> None:
        """One prompt's engine stream into ``queue``: ``("output", index, (output, finished or None))`` per step,
        ``("error", index, error)`` if it fails, then ``("end", index, None)``."""
        group, generator = self.engine.stream(prompt, param)
        finished = False
        try:
            async for ref in generator:
                output = await ref
                final = None
                if output.finished:
                    finished = True
                    final = await self.engine.finished_output(group)  # saves attached, from the merge actor
                queue.put_nowait(("output", index, (output, final)))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            # What died, named as every caller of the deployment hears it (a GCS read: off the loop).
            cause = await asyncio.get_running_loop().run_in_executor(None, self.engine.unwrap, error)
            queue.put_nowait(("error", index, cause))
        finally:
            if not finished:
                _cancel_stream(generator)  # the engine aborts the request and frees its workers
            queue.put_nowait(("end", index, None))

    async def _events(self, chunks: StreamChunks, route: str, pumps: list, queue: asyncio.Queue, first: tuple,
                      began: float, include_usage: bool, return_saves: bool):
        finished: list[Any] = [None] * len(pumps)
        ended = 0
        timed = False
        item = first
        try:
            for index in range(len(pumps)):
                start = chunks.start(index)
                if start is not None:
                    yield sse(start)
            while True:
                kind, index, value = item
                if kind == "error":
                    cause = _cause(value)
                    status = 400 if isinstance(cause, (ValueError, TypeError)) else 500
                    logger.warning("replica %s: stream failed: %s", self.engine_name, cause)
                    yield sse(error_body(status, f"{type(cause).__name__}: {cause}",
                                         "invalid_request_error" if status == 400 else "server_error"))
                    yield SSE_DONE
                    return
                if kind == "end":
                    ended += 1
                    if ended == len(pumps):
                        break
                else:
                    output, final = value
                    if not timed:
                        metrics.observe("nnsight_time_to_first_token_seconds", time.perf_counter() - began,
                                        route=route)
                        timed = True
                    chunk = chunks.step(index, output)
                    if chunk is not None:
                        yield sse(chunk)
                    if final is not None:
                        finished[index] = final
                item = await queue.get()
            closing = chunks.final(include_usage, finished if return_saves else None)
            self._count_outputs(finished, route, closing or {})
            if closing is not None:
                yield sse(closing)
            yield SSE_DONE
        finally:
            for pump in pumps:
                if not pump.done():
                    pump.cancel()


def _cancel_stream(generator: Any) -> None:
    import ray

    try:
        ray.cancel(generator)
    except Exception:  # already finished, or not a Ray generator
        logger.debug("could not cancel a stream", exc_info=True)
