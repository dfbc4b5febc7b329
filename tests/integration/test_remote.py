"""nnsight's own ``remote=True`` client against the Serve application, over real HTTP and websockets.

The application runs on the session's four-raylet cluster with two replicas,
both serving the session's TP=2 ``RayVLLM`` deployment (``ray_tp2``, ranks on
two raylets) through ``engine=``: no engine is started for this module. The
client is nnsight 0.8.1's unmodified ``RemoteBackend`` (``CONFIG.API.HOST`` set
to the application's URL, ``CONFIG.API.APIKEY`` to its key), driven through a
meta-only ``LocalVLLM`` (nnsight's ``VLLM`` cannot build its meta model without
a GPU); values are compared with the same trace sent with ``serve=`` and run on
``ray_tp2`` directly.
"""

from __future__ import annotations

import asyncio
import inspect
import time

import httpx
import pytest
import torch

from conftest import assert_close, free_port, layer_and_logits, multi_invoke, request_counts

pytestmark = pytest.mark.integration

APP = "nnsight-remote-test"
KEY = "remote-key-0123456789"
ALIAS = "tiny/llama"
READY_TIMEOUT_S = 300


def book(method: str = "stats", *args):
    from ray import serve

    return serve.get_deployment_handle("NNsightJobs", app_name=APP).call.remote(method, *args).result(timeout_s=60)


@pytest.fixture(scope="module")
def remote_url(ray_cluster, ray_tp2, model_dir):
    """The application up (two replicas attached to ``tp2``); nnsight's CONFIG pointed at it."""
    from nnsight import CONFIG
    from ray import serve

    from nnsight_ray.serve import build_app

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": model_dir, "engine": "tp2", "num_replicas": 2, "api_key": KEY,
                         "served_names": [ALIAS], "job_timeout_s": 120}), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    saved = (CONFIG.API.HOST, CONFIG.API.APIKEY, CONFIG.APP.REMOTE_LOGGING)
    CONFIG.API.HOST, CONFIG.API.APIKEY, CONFIG.APP.REMOTE_LOGGING = url, KEY, False
    try:
        deadline, ok = time.monotonic() + READY_TIMEOUT_S, 0
        while ok < 8:  # both replicas' engines attached (each request reaches either)
            assert time.monotonic() < deadline, "replicas not ready"
            ok = ok + 1 if httpx.get(f"{url}/health", timeout=30).status_code == 200 else 0
            time.sleep(0.5)
        yield url
    finally:
        CONFIG.API.HOST, CONFIG.API.APIKEY, CONFIG.APP.REMOTE_LOGGING = saved
        serve.delete(APP)
        serve.shutdown()
    assert ray_tp2.health()["alive"], "an attached engine must outlive the application"


@pytest.fixture(scope="module")
def client(model_dir):
    from nnsight_ray import LocalVLLM

    return LocalVLLM(model_dir)


def settled() -> dict:
    """The job book once no job is in flight: every accepted job ended."""
    deadline = time.monotonic() + 60
    while True:
        stats = book()
        if not set(stats["jobs"]) - {"COMPLETED", "ERROR"} and stats["sessions"] == 0:
            return stats
        assert time.monotonic() < deadline, f"jobs still open: {stats}"
        time.sleep(0.5)


def test_blocking_trace_equals_serve_and_rayvllm(remote_url, client, ray_tp2):
    remote = layer_and_logits(client, "Hello world", remote=True)
    served = layer_and_logits(client, "Hello world", serve=remote_url, api_key=KEY)
    direct = layer_and_logits(ray_tp2, "Hello world")
    for r, s, d in zip(remote, served, direct):
        assert_close(r, d, rel=1e-5)
        assert_close(s, d, rel=1e-5)


def test_several_invokes_with_an_edit(remote_url, client, ray_tp2):
    for got, want in zip(multi_invoke(client, remote=True), multi_invoke(ray_tp2)):
        assert_close(got, want, rel=1e-5)


def test_an_error_in_the_block_reaches_the_client_with_type_and_line(remote_url, client):
    from nnsight.intervention.backends.remote import RemoteError

    line = inspect.currentframe().f_lineno + 3
    with pytest.raises(RemoteError) as raised:
        with client.trace("Hello", temperature=0.0, max_tokens=1, remote=True):
            client.model.layers[2].output[0][10_000].save()
    message = str(raised.value)
    assert "IndexError" in message and f"line {line}," in message and "[10000]" in message, message
    assert_close(layer_and_logits(client, "Hello", remote=True)[0], layer_and_logits(client, "Hello",
                                                                                      serve=remote_url, api_key=KEY)[0])


def test_a_runaway_remote_job_ends_in_error_within_its_budget_and_others_finish(remote_url, client, ray_tp2):
    """A remote=True job whose block spins ends in ERROR after the engine's block_timeout_s (5 s on tp2);
    jobs submitted beside it finish with their values, and the engine is not restarted."""
    from concurrent.futures import ThreadPoolExecutor

    from nnsight.intervention.backends.remote import RemoteError

    want = layer_and_logits(client, "Hello world", serve=remote_url, api_key=KEY)[0]

    def runaway():
        with pytest.raises(RemoteError, match="block_timeout_s=5 ") as raised:
            with client.trace("A runaway tenant", temperature=0.0, max_tokens=2, remote=True):
                client.model.layers[0].output[0].save()
                while True:
                    pass
        return str(raised.value)

    def neighbour():
        began = time.monotonic()
        return layer_and_logits(client, "Hello world", remote=True)[0], time.monotonic() - began

    pids = [rank["pid"] for rank in ray_tp2.topology()]
    with ThreadPoolExecutor(5) as pool:
        bad = pool.submit(runaway)
        time.sleep(0.5)
        goods = [pool.submit(neighbour) for _ in range(4)]
        for future in goods:
            value, waited = future.result(timeout=120)
            assert_close(value, want)
            assert waited < 5.0 + 5, f"a neighbour waited {waited:.1f} s"
        assert "TimeoutError" in bad.result(timeout=120)
    assert [rank["pid"] for rank in ray_tp2.topology()] == pids  # the same ranks: nothing restarted
    assert set(request_counts(ray_tp2)) == {0}


def test_blocking_false_then_polling(remote_url, client, ray_tp2):
    tracers = []
    for prompt in ("Hello world", "abc"):
        with client.trace(prompt, temperature=0.0, max_tokens=1, remote=True, blocking=False) as tracer:
            hidden = client.model.layers[2].output[0].clone().save()
        assert tracer.backend.job_id
        tracers.append((prompt, tracer))
    for prompt, tracer in tracers:
        deadline = time.monotonic() + 120
        while (result := tracer.backend()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert tracer.backend.status.value == "COMPLETED"
        assert_close(result["hidden"], layer_and_logits(ray_tp2, prompt)[0], rel=1e-5)
    # The result was downloaded once; the job's URL is spent, and an unknown id ends, not 404s.
    assert book("response", tracers[0][1].backend.job_id, remote_url)["status"] == "ERROR"
    unknown = httpx.get(f"{remote_url}/response/nope", headers={"ndif-api-key": KEY})
    assert unknown.status_code == 200 and unknown.json()["status"] == "ERROR"


def test_a_result_over_32_mib_comes_through_the_url(remote_url, client):
    from nnsight import CONFIG
    from nnsight.intervention.backends.remote import AsyncRemoteBackend

    backend = AsyncRemoteBackend(client.to_model_key())
    with client.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        big = torch.randn(10 << 20, generator=torch.Generator().manual_seed(0)).save()  # 40 MiB, ~37 zstd

    async def updates():
        return [update async for update in backend]

    seen = asyncio.run(updates())
    completed, result = seen[-2], seen[-1]
    assert completed.status.value == "COMPLETED" and "/download/" in completed.data
    assert CONFIG.API.COMPRESS  # the result was zstd-compressed, and still over 32 MiB
    assert torch.equal(result["big"], torch.randn(10 << 20, generator=torch.Generator().manual_seed(0)))
    assert httpx.get(completed.data).status_code == 404  # single use
    assert settled()["stored_bytes"] == 0


def test_wrong_or_missing_key_is_refused(remote_url, client):
    from nnsight import CONFIG
    from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

    jobs = sum(book()["jobs"].values())
    for blocking in (True, False):
        with pytest.raises(RemoteError, match="Failed to send request: invalid API key"):
            with client.trace("Hello", max_tokens=1, backend=RemoteBackend(client.to_model_key(), api_key="wrong",
                                                                          blocking=blocking)):
                client.model.layers[0].output[0].save()
    CONFIG.API.APIKEY = None
    try:
        with pytest.raises(RemoteError, match="API key required"):
            with client.trace("Hello", max_tokens=1, remote=True):
                client.model.layers[0].output[0].save()
    finally:
        CONFIG.API.APIKEY = KEY
    assert sum(book()["jobs"].values()) == jobs and book()["sessions"] == 0  # nothing was accepted
    assert httpx.post(f"{remote_url}/request").status_code == 401
    assert httpx.post(f"{remote_url}/request", headers={"ndif-api-key": "wrong"}).status_code == 403
    assert httpx.get(f"{remote_url}/response/x").status_code == 401
    assert httpx.get(f"{remote_url}/ping").text == '"pong"'


def test_model_keys_are_checked_and_served_names_accepted(remote_url, client, model_dir):
    from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

    refused = {
        "nnsight.modeling.transformers.TransformersModel:{\"repo_id\": \"gpt2\"}": "HuggingFace transformers",
        "nnsight.modeling.vllm.vllm.VLLM:other/model": "not served here",
        "os.system:rm": "only runs vLLM engines",
    }
    for key, why in refused.items():
        with pytest.raises(RemoteError, match=why) as raised:
            with client.trace("Hello", max_tokens=1, backend=RemoteBackend(key)):
                client.model.layers[0].output[0].save()
        assert ALIAS in str(raised.value) and model_dir in str(raised.value)
    with client.trace("Hello", temperature=0.0, max_tokens=1,
                      backend=RemoteBackend(f"nnsight.modeling.vllm.vllm.VLLM:{ALIAS}")):
        hidden = client.model.layers[2].output[0].clone().save()
    assert_close(hidden, layer_and_logits(client, "Hello", remote=True)[0], rel=1e-5)
    status = httpx.get(f"{remote_url}/status", headers={"ndif-api-key": KEY}).json()
    assert status["deployments"][ALIAS]["application_state"] == "RUNNING"


def test_a_session_is_refused_clearly(remote_url, client):
    from nnsight.intervention.backends.remote import RemoteError

    with pytest.raises(RemoteError, match="session"):
        with client.session(remote=True):
            with client.trace("Hello", max_tokens=1):
                client.model.layers[0].output[0].save()


def test_a_client_that_leaves_mid_job_still_ends_and_nothing_leaks(remote_url, client, ray_tp2):
    from nnsight.intervention.backends.remote import AsyncRemoteBackend

    before = book()["jobs"].get("COMPLETED", 0)
    backend = AsyncRemoteBackend(client.to_model_key())
    with client.trace("Hello", temperature=0.0, max_tokens=120, ignore_eos=True, backend=backend):
        client.model.layers[2].output[0].save()
    backend.close()  # gone while the engine generates
    stats = settled()
    assert stats["jobs"]["COMPLETED"] == before + 1 and stats["stored_bytes"] == 0 and stats["downloads"] == 0
    assert set(request_counts(ray_tp2)) == {0}


def test_two_replicas_share_jobs(remote_url, client):
    """Subscriptions and jobs land on both replicas, and a job run on one is heard on the other's websocket."""
    deadline = time.monotonic() + 90
    while True:
        layer_and_logits(client, "abc", remote=True)
        stats = book()
        if len(stats["ran_on"]) == 2 and stats["crossed_replicas"]:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.3)
