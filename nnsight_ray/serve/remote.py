"""nnsight's ``remote=True`` protocol (NDIF's), spoken by every replica over its own engine.

An unmodified nnsight 0.8.1 client with ``CONFIG.API.HOST`` (``NDIF_HOST``)
pointed here and ``NDIF_API_KEY`` set to the application's key runs
``model.trace(..., remote=True)`` against this application's engine. What its
``RemoteBackend`` does, and what answers it here:

- blocking: ``WS /subscribe`` (first text frame ``{"session_id": ...}``), then
  ``POST /request`` (multipart: ``data`` = ``RequestModel`` JSON, ``blob`` = the
  serialized trace, zstd when ``compress``) answered with the job's RECEIVED
  ``ResponseModel``; then status frames on the websocket (text JSON), the
  COMPLETED one a binary ``ResponseModel.pickle()`` carrying the result, or
  JSON whose ``data`` is a download URL for a large one;
- ``blocking=False``: an empty ``session_id``, then ``GET /response/{id}`` until
  COMPLETED, whose ``data`` is the download URL;
- ``GET /download/{token}``: the result, once, without a header (the client
  sends none); the token is the capability;
- ``GET /ping``; ``GET /status`` in NDIF's shape (what is served).

The result is ``torch.save({name: value})``, zstd-compressed when the request
was (nnsight's ``RemoteBackend.finalize`` undoes exactly that). A trace is
rebuilt with ``protocol.build_trace`` as for ``serve=``, so values are those of
the same trace sent with ``serve=url``. An intervention's error ends the job in
ERROR whose description is nnsight's own rendering of it (type, message,
intervention traceback: ``raise_deferred``), which the client raises as
``RemoteError``.

Model keys name a class and a checkpoint (``"nnsight.modeling.vllm.vllm.VLLM:
meta-llama/Llama-3.1-8B"``). A key is user input: it is compared as text with
what this application serves (``ModelKeys``) and nothing it names is imported.

Job state lives in the application's ``NNsightJobs`` (``jobs.JobBook``): the
websocket and the POST may reach different replicas. The handlers reach it and
the engine only through what the Serve edge hands them (``RemoteHost``), so no
Ray call is made here.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations.
import asyncio
import io
import json
import logging
from typing import Any, Awaitable, Callable, Protocol

from fastapi import FastAPI, HTTPException, Request, Response, WebSocket
from fastapi.responses import JSONResponse

from ..errors import RequestError
from .jobs import DOWNLOAD_PATH, JobLimits
from .protocol import build_trace
from .security import tenant

__all__ = ["VLLM_CLASSES", "ModelKeys", "RemoteRoutes", "describe_error", "encode_result"]

logger = logging.getLogger(__name__)

#: Client classes whose traces are written against vLLM's module tree (what every engine here runs).
VLLM_CLASSES = ("nnsight.modeling.vllm.vllm.VLLM", "nnsight_ray.local.LocalVLLM", "nnsight_ray.ray_vllm.RayVLLM")
SUBSCRIBE_POLL_S = 5.0


class KeyRefused(ValueError):
    """A model key this application does not serve; the message lists what it serves."""


class ModelKeys:
    """Which ``"<class>:<checkpoint>"`` keys reach this application's engine.

    Args:
        names: the checkpoint names a key may carry: the model path, the
            configured ``served_names`` (hub ids, short names), the engine name.
    """

    def __init__(self, names: list[str]) -> None:
        self.names = list(dict.fromkeys(n for n in names if n))

    def served(self) -> list[str]:
        return [f"{VLLM_CLASSES[0]}:{name}" for name in self.names]

    def check(self, key: str) -> str:
        """The checkpoint name of an accepted key; :class:`KeyRefused` saying why and what is served otherwise."""
        cls, sep, name = key.partition(":")
        listing = (f"This server serves {self.names} through vLLM; build the client model as nnsight's "
                   f"VLLM(<name>) (nnsight_ray.LocalVLLM(<name>) on a machine without a GPU) with one of those "
                   f"names, e.g. model key {self.served()[0]!r}.")
        if not sep:
            raise KeyRefused(f"{key!r} is not an nnsight model key ('<module>.<Class>:<checkpoint>'). {listing}")
        if cls not in VLLM_CLASSES:
            kind = ("a HuggingFace transformers model (its trace is written against the transformers module tree, "
                    "not vLLM's)" if cls.startswith("nnsight.modeling.") else f"a {cls.rpartition('.')[2]} model")
            raise KeyRefused(f"model key {key[:200]!r} is for {kind}; this server only runs vLLM engines. {listing}")
        if name not in self.names:
            raise KeyRefused(f"model {name[:200]!r} is not served here. {listing}")
        return name


def encode_result(saves: dict[str, Any], compress: bool) -> bytes:
    """The result blob nnsight's ``RemoteBackend.finalize`` reads: ``torch.save`` of the saves, zstd if asked."""
    import torch

    buffer = io.BytesIO()
    torch.save(saves, buffer, pickle_protocol=4)
    data = buffer.getvalue()
    if compress:
        import zstandard as zstd

        data = zstd.ZstdCompressor(level=3).compress(data)
    return data


def describe_error(error: dict) -> str:
    """A deferred error (``capture_exception``'s dict) as nnsight renders it: type, message, traceback."""
    from nnsight.intervention.errors import raise_deferred

    try:
        raise_deferred(error)
    except RuntimeError as rendered:
        return str(rendered)
    return "the trace stopped early"


class RemoteHost(Protocol):
    """What the routes need from their replica (``deployment.NNsightDeployment``)."""

    name: str
    model: Any
    persistent_objects: dict | None
    jobs: Any  # async methods of jobs.JobBook, reached over the application's handle
    limits: JobLimits
    public_url: str | None
    tenants: Any  # job_store.TenantsClient: async refusal(tenant) / charge(tenant, error), the cool-downs

    def ready(self) -> None: ...  # raises HTTPException(503) until the engine is up

    def run_trace(self, built: Any) -> Awaitable[dict[str, Any]]: ...  # submit; the merged saves

    def job_ended(self, saved_bytes: int, error_type: str | None) -> None: ...  # metrics


def _base_url(url: Any) -> str:
    text = str(url)
    return "http" + text[2:] if text.startswith("ws") else text


class RemoteRoutes:
    """The ``remote=True`` routes of one replica (mounted by the replica's ``__serve_build_asgi_app__``)."""

    def __init__(self, host: RemoteHost, keys: ModelKeys,
                 build: Callable[[Any, bytes, dict, bool], Any] = build_trace) -> None:
        self.host = host
        self.keys = keys
        self.build = build
        self.tasks: set[asyncio.Task] = set()

    def mount(self, app: FastAPI) -> None:
        app.add_api_route("/ping", self.ping, methods=["GET"])
        app.add_api_route("/status", self.status, methods=["GET"])
        app.add_api_route("/request", self.request, methods=["POST"])
        app.add_api_route("/response/{job_id}", self.response, methods=["GET"])
        app.add_api_route(DOWNLOAD_PATH + "{token}", self.download, methods=["GET"])
        app.add_api_websocket_route("/subscribe", self.subscribe)

    def base_url(self, url: Any) -> str:
        return self.host.public_url or _base_url(url)

    async def ping(self) -> str:
        return "pong"

    async def status(self) -> dict[str, Any]:
        """NDIF's ``/status`` shape (``nnsight.status()``): one entry per served name."""
        try:
            self.host.ready()
            state = "RUNNING"
        except HTTPException:
            state = "DEPLOYING"
        return {"deployments": {name: {"model_key": key, "repo_id": name, "deployment_level": "HOT",
                                       "application_state": state}
                                for name, key in zip(self.keys.names, self.keys.served())}}

    # -- submit -------------------------------------------------------------------

    async def request(self, request: Request) -> Response:
        """``POST /request``: check, record (RECEIVED), answer; the job runs on in the background."""
        self.host.ready()
        who = tenant(request.scope)
        refusal, tracked = await self.host.tenants.admit(who)
        if refusal is not None:
            raise HTTPException(429, refusal.detail, headers=refusal.headers())
        try:
            accepted, payload, compress = await self._accept(request)
        except BaseException:
            await asyncio.shield(self.host.tenants.end(who, None, tracked))
            raise
        task = asyncio.ensure_future(self._run(accepted["id"], payload, compress, who, tracked))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return JSONResponse(accepted)

    async def _accept(self, request: Request) -> tuple[dict, bytes, bool]:
        """Check the form and the model key, record the job (RECEIVED): ``(the answer, the blob, compress)``."""
        from nnsight.schema.request import RequestModel
        from pydantic import ValidationError

        form = await request.form()
        data, blob = form.get("data"), form.get("blob")
        if data is None or blob is None or isinstance(blob, str):
            raise HTTPException(400, "POST /request takes multipart fields 'data' (RequestModel JSON) and 'blob' "
                                "(the serialized trace), as nnsight's RemoteBackend sends them")
        try:
            meta = RequestModel.model_validate_json(data)
        except ValidationError as error:
            raise HTTPException(400, f"'data' is not a RequestModel: {error}") from None
        try:
            self.keys.check(meta.model_key)
        except KeyRefused as error:
            raise HTTPException(404, str(error)) from None
        if meta.env:
            raise HTTPException(400, f"env {sorted(meta.env)} is not supported by this server (a vLLM model "
                                "sends none); remove it")
        payload = await blob.read()
        try:
            accepted = await self.host.jobs.accept(meta.model_key, meta.session_id, self.host.name)
        except KeyError as error:  # UnknownSession, come back through the handle
            raise HTTPException(400, str(error)) from None
        return accepted, payload, meta.compress

    async def _run(self, job_id: str, payload: bytes, compress: bool, who: str | None = None,
                   tracked: bool = False) -> None:
        """One job to its end, and its tenant told (``tenants.py``): a stopped block starts a cool-down."""
        failed: list[dict] = []
        try:
            await self._job(job_id, payload, compress, failed)
        finally:
            await asyncio.shield(self.host.tenants.end(who, failed[0] if failed else None, tracked))

    async def _job(self, job_id: str, payload: bytes, compress: bool, failed: list) -> None:
        """QUEUED, build, RUNNING, the engine, then COMPLETED or ERROR (never neither); ``failed`` gets the error."""
        jobs = self.host.jobs
        try:
            await jobs.update(job_id, "QUEUED", "Your job is building on the replica.")
            try:
                built = self.build(self.host.model, payload, self.host.persistent_objects, compress)
            except Exception as error:
                await self._fail(job_id, error, "the trace failed to build")
                return
            await jobs.update(job_id, "RUNNING", "Your job has started running.")
            timeout = self.host.limits.job_timeout_s
            try:
                saves = await asyncio.wait_for(self.host.run_trace(built), timeout)
            except Exception as error:
                # asyncio.TimeoutError is the builtin TimeoutError: an intervention's own (a block stopped past
                # its budget comes back as a RequestError that is also a TimeoutError) is the job's error.
                if isinstance(error, asyncio.TimeoutError) and not isinstance(error, RequestError):
                    await jobs.fail(job_id, f"the job did not finish within job_timeout_s ({timeout:g} s); the "
                                    "engine finishes it and drops its result")
                    return
                deferred = getattr(error, "deferred", None)
                if deferred is not None and deferred.get("is_control_flow"):
                    saves = {}
                else:
                    failed.append(await self._fail(job_id, error, "the trace failed"))
                    return
            result = encode_result(saves, compress)
            await jobs.complete(job_id, result)
            self.host.job_ended(len(result), None)
        except asyncio.CancelledError:  # the replica is stopping: say so rather than let the deadline do it
            await asyncio.shield(jobs.fail(job_id, f"replica {self.host.name} stopped while running the job"))
            raise
        except Exception as error:  # the book itself failed: log; its deadline ends the job
            logger.exception("replica %s: job %s could not report its end: %s", self.host.name, job_id, error)

    async def _fail(self, job_id: str, error: BaseException, what: str) -> dict:
        from nnsight.intervention.errors import capture_exception

        logger.info("replica %s: job %s: %s: %s", self.host.name, job_id, what, error)
        deferred = getattr(error, "deferred", None) or capture_exception(error)
        await self.host.jobs.fail(job_id, describe_error(deferred))
        self.host.job_ended(0, str(deferred.get("type_name")))
        return deferred

    # -- reads ------------------------------------------------------------------------

    async def response(self, job_id: str, request: Request) -> dict[str, Any]:
        """``GET /response/{id}``: the latest status (a non-blocking client polls this)."""
        return await self.host.jobs.response(job_id, self.base_url(request.base_url))

    async def download(self, token: str) -> Response:
        """``GET /download/{token}``: the result, once. No key: the token is the capability."""
        result = await self.host.jobs.take_download(token)
        if result is None:
            raise HTTPException(404, "no such result: unknown token, already downloaded, or expired")
        return Response(result, media_type="application/octet-stream")

    # -- subscribe ----------------------------------------------------------------------

    async def subscribe(self, websocket: WebSocket) -> None:
        """``WS /subscribe``: the session id first, then every status of the session's jobs as it happens."""
        await websocket.accept()
        session = await self.host.jobs.open_session(self.host.name)
        base_url = self.base_url(websocket.base_url)
        gone = asyncio.ensure_future(_until_disconnect(websocket))
        try:
            await websocket.send_text(json.dumps({"session_id": session}))
            while not gone.done():
                fetch = asyncio.ensure_future(self.host.jobs.next_frames(session, base_url, SUBSCRIBE_POLL_S))
                await asyncio.wait({fetch, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not fetch.done():
                    fetch.cancel()
                    break
                frames = fetch.result()
                if frames is None:
                    break
                for kind, frame in frames:
                    if kind == "bytes":
                        await websocket.send_bytes(frame)
                    else:
                        await websocket.send_text(frame)
        except Exception as error:  # the client went away mid-send, or the book failed
            logger.info("replica %s: subscription %s ended: %s", self.host.name, session, error)
        finally:
            client_left = gone.done()
            gone.cancel()
            await asyncio.shield(self.host.jobs.close_session(session))
            if not client_left:
                try:
                    await websocket.close()
                except Exception:  # already closed
                    pass


async def _until_disconnect(websocket: WebSocket) -> None:
    while (await websocket.receive())["type"] != "websocket.disconnect":
        pass
