"""``remote=True`` without Ray: the job book, model keys, the result blob, the routes on fakes.

The book runs on a fake clock and fake tokens; the routes run in a Starlette
test client over a fake replica (a book in the same process, a fake build and
engine). No test starts or joins Ray (``ray.init`` raises).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI, HTTPException
from starlette.testclient import TestClient

from nnsight_ray.serve import ServeArgs, ServeArgsError
from nnsight_ray.serve.jobs import JobBook, JobLimits, UnknownSession
from nnsight_ray.serve.remote import KeyRefused, ModelKeys, RemoteRoutes, describe_error, encode_result
from nnsight_ray.serve.security import GuardMiddleware
from nnsight_ray.serve.tenants import TenantBook

URL = "http://example:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def new_book(**limits) -> tuple[JobBook, Clock]:
    clock = Clock()
    tokens = iter(f"tok{i}" for i in range(1000))
    return JobBook(JobLimits(**limits), clock=clock, token=lambda: next(tokens)), clock


def frames(book: JobBook, session: str, timeout: float = 0.01):
    return asyncio.run(book.next_frames(session, URL, timeout))


# --------------------------------------------------------------------------- the job book


def test_a_blocking_job_moves_forward_only_and_its_small_result_rides_the_socket_once():
    from nnsight.schema.response import ResponseModel

    book, _ = new_book(inline_result_bytes=100)
    session = book.open_session("r1")
    job = book.accept("k", session, "r2")
    assert job["status"] == "RECEIVED"
    assert book.stats()["running_on"] == {"r2": 1}  # not final: counted where it runs
    assert book.update(job["id"], "RUNNING", "running")
    assert not book.update(job["id"], "QUEUED")  # never backwards
    assert book.complete(job["id"], b"x" * 10)
    assert not book.fail(job["id"], "late")  # final stays final
    sent = frames(book, session)
    assert [kind for kind, _ in sent] == ["text", "bytes"]
    assert json.loads(sent[0][1])["status"] == "RUNNING"
    done = ResponseModel.unpickle(sent[1][1])
    assert done.status.value == "COMPLETED" and done.data == b"x" * 10
    assert book.stored_bytes() == 0 and book.job(job["id"])["subscriber"] == "r1"
    assert book.stats()["running_on"] == {} and book.stats()["ran_on"] == {"r2": 1}
    assert frames(book, session) == []


def test_a_large_result_waits_behind_a_single_use_url():
    book, _ = new_book(inline_result_bytes=4)
    session = book.open_session("r1")
    job = book.accept("k", session, "r1")["id"]
    book.complete(job, b"0123456789")
    (kind, text), = frames(book, session)
    assert kind == "text" and json.loads(text)["data"] == f"{URL}/download/tok0"
    assert book.take_download("tok0") == b"0123456789"
    assert book.take_download("tok0") is None and book.stored_bytes() == 0


def test_a_non_blocking_job_is_polled_and_unknown_ids_end_instead_of_404():
    book, _ = new_book()
    job = book.accept("k", "", "r1")["id"]
    assert book.response(job, URL)["status"] == "RECEIVED"
    book.complete(job, b"abc")
    assert book.response(job, URL) == {"id": job, "status": "COMPLETED", "description": "Your job has been completed.",
                                       "data": f"{URL}/download/tok0"}
    assert book.take_download("tok0") == b"abc"
    assert book.response(job, URL)["status"] == "ERROR"  # fetched
    assert book.response("nope", URL)["status"] == "ERROR"


def test_unknown_sessions_are_refused():
    book, _ = new_book()
    with pytest.raises(UnknownSession, match="open WS /subscribe"):
        book.accept("k", "never-opened", "r1")


def test_size_bounds_end_the_job_in_error():
    book, _ = new_book(max_result_bytes=10, max_stored_bytes=15)
    a, b, c = (book.accept("k", "", "r")["id"] for _ in range(3))
    book.complete(a, b"x" * 11)
    assert book.job(a)["status"] == "ERROR" and "max_result_bytes" in book.job(a)["description"]
    book.complete(b, b"x" * 10)
    book.complete(c, b"x" * 10)
    assert book.job(b)["status"] == "COMPLETED"
    assert book.job(c)["status"] == "ERROR" and "store is full" in book.job(c)["description"]
    assert book.stored_bytes() == 10


def test_a_client_that_leaves_drops_its_results_and_the_job_still_ends():
    book, _ = new_book()
    session = book.open_session("r1")
    early = book.accept("k", session, "r1")["id"]
    book.complete(early, b"held")  # inline, not yet sent
    late = book.accept("k", session, "r1")["id"]
    book.close_session(session)
    assert book.stored_bytes() == 0 and frames(book, session) is None
    book.complete(late, b"nobody")
    assert book.job(late)["status"] == "COMPLETED" and not book.job(late)["stored"]
    assert book.stats()["sessions"] == 0


def test_a_waiting_subscription_wakes_on_a_status_and_on_close():
    book, _ = new_book()

    async def run():
        session = book.open_session("r1")
        job = book.accept("k", session, "r1")["id"]
        waiter = asyncio.ensure_future(book.next_frames(session, URL, 10))
        await asyncio.sleep(0)
        book.update(job, "QUEUED")
        got = await asyncio.wait_for(waiter, 1)
        waiter = asyncio.ensure_future(book.next_frames(session, URL, 10))
        await asyncio.sleep(0)
        book.close_session(session)
        return got, await asyncio.wait_for(waiter, 1)

    got, closed = asyncio.run(run())
    assert json.loads(got[0][1])["status"] == "QUEUED" and closed is None


def test_deadlines_end_lost_jobs_and_ttl_forgets_finished_ones():
    book, clock = new_book(job_timeout_s=10, result_ttl_s=5)
    lost = book.accept("k", "", "r1")["id"]
    done = book.accept("k", "", "r1")["id"]
    book.complete(done, b"abc")
    clock.now = 6
    book.sweep()
    assert done not in book.jobs and book.take_download("tok0") is None  # expired with its result
    assert book.job(lost)["status"] == "RECEIVED"
    clock.now = 10 + 30 + 1  # job_timeout_s plus the grace for the replica's own report
    book.sweep()
    assert book.job(lost)["status"] == "ERROR" and "no result within" in book.job(lost)["description"]
    clock.now += 6
    book.sweep()
    assert book.jobs == {}


# --------------------------------------------------------------------------- model keys, blobs, errors


def test_model_keys_are_text_never_imports(monkeypatch):
    import importlib

    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: pytest.fail("a key was imported"))
    keys = ModelKeys(["/models/llama", "meta-llama/Llama-3.1-8B", "/models/llama"])
    assert keys.names == ["/models/llama", "meta-llama/Llama-3.1-8B"]
    for cls in ("nnsight.modeling.vllm.vllm.VLLM", "nnsight_ray.local.LocalVLLM", "nnsight_ray.ray_vllm.RayVLLM"):
        assert keys.check(f"{cls}:meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    refusals = {
        'nnsight.modeling.transformers.TransformersModel:{"repo_id": "gpt2"}': "HuggingFace transformers",
        "nnsight.modeling.vllm.vllm.VLLM:gpt2": "'gpt2' is not served here",
        "subprocess.Popen:ls": "Popen model",
        "no-colon": "not an nnsight model key",
    }
    for key, why in refusals.items():
        with pytest.raises(KeyRefused, match=why) as raised:
            keys.check(key)
        assert "nnsight.modeling.vllm.vllm.VLLM:/models/llama" in str(raised.value)


def test_serve_args_for_remote():
    args = ServeArgs.parse({"model": "/m", "served_names": "a/b, c", "engine": "tp2", "result_ttl_s": "30"})
    assert args.model_names() == ["/m", "a/b", "c", "tp2"] and args.job_limits().result_ttl_s == 30
    with pytest.raises(ServeArgsError, match="engine= serves a running deployment"):
        ServeArgs.parse({"model": "/m", "engine": "tp2", "tensor_parallel_size": 2})
    with pytest.raises(ServeArgsError, match="max_result_bytes"):
        ServeArgs.parse({"model": "/m", "max_result_bytes": 0})


@pytest.mark.parametrize("compress", [False, True])
def test_the_result_blob_is_what_nnsights_client_reads(compress):
    from nnsight.intervention.backends.remote import RemoteBackend

    saves = {"h": torch.arange(6.0).reshape(2, 3), "n": [1, "x"]}
    client = RemoteBackend("k", host=URL)
    client.compress = compress
    got = client.finalize(encode_result(saves, compress))
    assert torch.equal(got["h"], saves["h"]) and got["n"] == [1, "x"]


def test_errors_read_as_nnsight_renders_them():
    from nnsight.intervention.errors import capture_exception

    try:
        [][1]
    except IndexError as error:
        text = describe_error(capture_exception(error))
    assert text.startswith("IndexError: list index out of range") and "test_remote_unit.py" in text
    assert describe_error({"type_name": "EarlyStopException", "is_control_flow": True}) == "the trace stopped early"


# --------------------------------------------------------------------------- the routes, on a fake replica


class LocalJobs:
    """The book's methods as coroutines, as ``job_store.JobsClient`` gives them over the handle."""

    def __init__(self, book: JobBook) -> None:
        self.book = book

    def __getattr__(self, method):
        async def call(*args):
            result = getattr(self.book, method)(*args)
            return await result if asyncio.iscoroutine(result) else result

        return call


@pytest.fixture
def fake_replica():
    """A factory of fake replicas, each served by a test client on one event loop for the whole test
    (as a replica's loop is: a job outlives the request that started it)."""
    clients = []

    def make(*args, **kwargs):
        host, client = replica(*args, **kwargs)
        clients.append(client.__enter__())
        return host, client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


class LocalTenants:
    """``job_store.TenantsClient`` without Serve: the book in this process."""

    def __init__(self, penalty: float) -> None:
        self.book = TenantBook(penalty)

    async def admit(self, tenant):
        return self.book.admit(tenant)

    async def end(self, tenant, error, tracked):
        self.book.end(tenant, error, tracked)


def replica(run_trace, build=lambda model, payload, objects, compress: payload, ready=True, api_key="k3y",
            penalty=0.0, **limits):
    host = SimpleNamespace(name="r1", model=None, persistent_objects={},
                           limits=JobLimits(**{"inline_result_bytes": 1 << 20, **limits}), public_url=None,
                           jobs=LocalJobs(JobBook()), run_trace=run_trace, ended=[], tenants=LocalTenants(penalty))
    host.job_ended = lambda size, error_type: host.ended.append((size, error_type))

    def check_ready():
        if not ready:
            raise HTTPException(503, "Engine not ready (starting)")

    host.ready = check_ready
    app = FastAPI()
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=1 << 20)
    RemoteRoutes(host, ModelKeys(["/m"]), build=build).mount(app)
    return host, TestClient(app)


def post(client, key="nnsight_ray.local.LocalVLLM:/m", session="", compress=False, headers=None):
    from nnsight.schema.request import RequestModel

    data = RequestModel(model_key=key, session_id=session, compress=compress).metadata()
    return client.post("/request", data={"data": data}, files={"blob": ("request", b"trace", "application/octet-stream")},
                       headers={"ndif-api-key": "k3y"} if headers is None else headers)


def test_subscribe_then_post_gets_every_status_and_the_result(fake_replica):
    from nnsight.schema.response import ResponseModel

    async def run_trace(built):
        assert built == b"trace"
        return {"h": torch.ones(2)}

    host, client = fake_replica(run_trace)
    with client.websocket_connect("/subscribe", headers={"ndif-api-key": "k3y"}) as socket:
        session = json.loads(socket.receive_text())["session_id"]
        reply = post(client, session=session)
        assert reply.status_code == 200 and reply.json()["status"] == "RECEIVED"
        statuses = [json.loads(socket.receive_text())["status"] for _ in range(2)]
        done = ResponseModel.unpickle(socket.receive_bytes())
    assert statuses == ["QUEUED", "RUNNING"] and done.status.value == "COMPLETED"
    assert torch.equal(torch.load(__import__("io").BytesIO(done.data), weights_only=False)["h"], torch.ones(2))
    assert host.jobs.book.stats()["sessions"] == 0  # closed with the socket


def test_a_failing_trace_ends_in_error_and_a_refused_key_or_model_never_runs(fake_replica):
    async def run_trace(built):
        raise IndexError("index 10000 is out of bounds")

    host, client = fake_replica(run_trace)
    job = post(client).json()["id"]
    for _ in range(100):
        answer = client.get(f"/response/{job}", headers={"ndif-api-key": "k3y"}).json()
        if answer["status"] == "ERROR":
            break
    assert answer["description"].startswith("IndexError: index 10000")
    assert post(client, headers={}).status_code == 401
    assert post(client, headers={"ndif-api-key": "no"}).status_code == 403
    refused = post(client, key="nnsight.modeling.vllm.vllm.VLLM:other")
    assert refused.status_code == 404 and "not served here" in refused.json()["detail"]
    assert post(client, session="made-up").status_code == 400
    assert client.get("/ping").status_code == 200 and client.get("/download/x").status_code == 404
    from starlette.websockets import WebSocketDisconnect

    with client.websocket_connect("/subscribe", headers={"ndif-api-key": "no"}) as socket:
        assert json.loads(socket.receive_text()) == {"session_id": "", "status": 403, "detail": "invalid API key"}
        with pytest.raises(WebSocketDisconnect) as closed:
            socket.receive_text()
    assert closed.value.code == 1008 and host.jobs.book.stats()["sessions"] == 0
    _, starting = fake_replica(run_trace, ready=False)
    assert post(starting).status_code == 503


def final(client, job: str, key: str = "k3y") -> dict:
    import time

    deadline = time.monotonic() + 10
    while (answer := client.get(f"/response/{job}", headers={"ndif-api-key": key}).json())["status"] not in (
            "COMPLETED", "ERROR"):
        assert time.monotonic() < deadline, answer
        time.sleep(0.02)
    return answer


def test_every_way_a_job_can_fail_still_ends_it(fake_replica):
    from nnsight_ray.errors import EngineDeadError

    async def slow(built):
        await asyncio.sleep(30)

    async def dead(built):
        raise EngineDeadError("the engine is dead: rank tp2.pp0.tp1 on node abc died")

    def session(model, payload, objects, compress):
        raise TypeError("got a Tracer (model.session(...) is not supported)")

    host, client = fake_replica(slow, job_timeout_s=0.2)
    assert "job_timeout_s (0.2 s)" in final(client, post(client).json()["id"])["description"]
    host, client = fake_replica(dead)
    answer = final(client, post(client).json()["id"])
    assert answer["description"].startswith("EngineDeadError: the engine is dead: rank tp2.pp0.tp1")
    assert host.ended == [(0, "EngineDeadError")]
    _, client = fake_replica(dead, build=session)
    assert "model.session(...) is not supported" in final(client, post(client).json()["id"])["description"]

    async def stopped_block(built):  # a block stopped past its budget: typed TimeoutError, not the job's deadline
        from nnsight_ray.errors import intervention_error

        raise intervention_error({"type_name": "TimeoutError", "message": "request r: ... block_timeout_s=5 ..."},
                                 "TimeoutError: request r: ... block_timeout_s=5 ...")

    host, client = fake_replica(stopped_block)
    answer = final(client, post(client).json()["id"])
    assert "block_timeout_s=5" in answer["description"] and "job_timeout_s" not in answer["description"]


def test_a_tenant_whose_block_was_stopped_is_refused_for_a_while_and_others_are_not(fake_replica):
    """Each tenant its own key: the one whose block ran away gets 429 with Retry-After on its next job,
    for runaway_penalty x the time the block held the engine; another tenant's jobs go on."""
    from nnsight_ray.errors import block_held, intervention_error

    async def run_trace(built):
        if built == b"runaway":
            message = f"request r: {block_held(2.0)} from its start ...; the limit is block_timeout_s=2"
            raise intervention_error({"type_name": "BlockTimeoutError", "message": message}, message)
        return {"h": torch.ones(1)}

    keys = {"alice": "a-key", "mallory": "m-key"}
    host, client = fake_replica(run_trace, build=lambda model, payload, objects, compress: payload,
                                api_key=keys, penalty=3.0)

    def job(key, blob=b"trace"):
        from nnsight.schema.request import RequestModel

        data = RequestModel(model_key="nnsight_ray.local.LocalVLLM:/m", session_id="", compress=False).metadata()
        return client.post("/request", data={"data": data}, files={"blob": ("request", blob, "application/octet-stream")},
                           headers={"ndif-api-key": key})

    answer = final(client, job("m-key", b"runaway").json()["id"], "m-key")
    assert answer["status"] == "ERROR" and "BlockTimeoutError" in answer["description"]
    refused = job("m-key")
    assert refused.status_code == 429 and "tenant 'mallory'" in refused.json()["detail"]
    assert 5 <= int(refused.headers["retry-after"]) <= 6  # 3 x 2.0 s
    assert final(client, job("a-key").json()["id"], "a-key")["status"] == "COMPLETED"


def test_a_trace_stopped_early_completes_with_what_it_saved(fake_replica):
    async def stopped(built):
        error = RuntimeError("stopped")
        error.deferred = {"type_name": "EarlyStopException", "is_control_flow": True}
        raise error

    host, client = fake_replica(stopped)
    assert final(client, post(client).json()["id"])["status"] == "COMPLETED"
    assert host.ended and host.ended[0][1] is None


def test_a_replica_that_stops_mid_job_ends_it():
    """Without an entered client every request gets an event loop of its own, closed after it: the job's
    task is cancelled as a stopping replica's would be."""

    async def slow(built):
        await asyncio.sleep(30)

    host, client = replica(slow)
    job = post(client).json()["id"]
    assert host.jobs.book.job(job)["status"] == "ERROR"
    assert host.jobs.book.job(job)["description"] == "replica r1 stopped while running the job"


def test_a_subscription_nobody_polls_is_forgotten():
    from nnsight_ray.serve.jobs import SESSION_IDLE_S

    book, clock = new_book()
    polled, lost = book.open_session("r1"), book.open_session("r2")
    job = book.accept("k", lost, "r1")["id"]
    book.complete(job, b"inline")
    clock.now = SESSION_IDLE_S / 2
    frames(book, polled)
    clock.now = SESSION_IDLE_S + 1
    book.sweep()
    assert set(book.sessions) == {polled} and book.stored_bytes() == 0
