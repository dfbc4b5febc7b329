"""The Ray Serve application over real HTTP on 127.0.0.1, real CPU engines.

One application serves every test: two replicas, each owning its own engine (one
rank actor in a placement group of its own), started once for the module (engines take a
minute or two on this machine). Serve over a multi-rank engine is test_remote.py's (its
replicas attach to the session's TP=2 engine); replicas owning PP=2 engines (until
967ec72) started two rank workers each on the 2-core CI machine and tested nothing Serve does differently.
Clients are nnsight's own: a meta-only ``LocalVLLM(path)`` with
``serve=url``; values are checked against nnsight's in-process single-rank
engine (``local_llama``).
"""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
import torch

from conftest import ENGINE_KWARGS, assert_close, free_port, layer_and_logits, multi_invoke
from scrape import export_ports, scrape, total

pytestmark = pytest.mark.integration

APP = "nnsight-serve-test"
KEY = "test-key-0123456789"  # the tenant "default"
MALLORY = "mallory-key-0123456789"  # a tenant of her own (api_keys): the one whose blocks run away
MAX_BODY = 1 << 20
READY_TIMEOUT_S = 900


def registry_status(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("NNsightRegistry", app_name=app).status.remote().result(timeout_s=60)


def wait_ready(app: str, replicas: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(registry_status(app)["engines"]) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{app}: {replicas} engines not ready after {READY_TIMEOUT_S} s")
        time.sleep(2)


def engine_request_counts(app: str) -> list[int]:
    counts = []
    for engine in registry_status(app)["engines"]:
        actor = ray.get_actor(f"{engine}.engine", namespace="nnsight_ray")
        counts += ray.get(actor.rpc.remote("nnsight_request_count", ()), timeout=60)
    return counts


@pytest.fixture(scope="module")
def served(ray_cluster, model_dir):
    """``{"url", "first_health"}``: the application up, both replicas' engines ready."""
    from ray import serve

    from nnsight_ray._internal.deploy import list_deployments
    from nnsight_ray.serve import build_app

    port = free_port()
    # One proxy: the simulated nodes share 127.0.0.1, so proxies on every node
    # would share (and fight over) one port (docs/clusters.md, "Pitfalls").
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    # block_timeout_s: a tenant's runaway block is stopped after 2 s (test_a_runaway_serve_trace_...), and
    # one stuck in a C call fail-stops its engine 3 s after that (test_a_block_stuck_...);
    # two tenants, so a runaway one cools down; a replica whose engine stalls 1 s is routed around.
    serve.run(build_app({"model": model_dir, "engine_kwargs": {**ENGINE_KWARGS, "block_timeout_s": 2.0,
                                                                "block_stop_grace_s": 3.0},
                         "num_replicas": 2,
                         "placement_strategy": "SPREAD",
                         "api_key": KEY, "api_keys": {"mallory": MALLORY}, "stalled_after_s": 1.0,
                         "max_body_bytes": MAX_BODY}), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    first = httpx.get(f"{url}/health", timeout=30)
    try:
        wait_ready(APP, 2)
        yield {"url": url, "first_health": (first.status_code, first.json())}
    finally:
        serve.delete(APP)
        serve.shutdown()
        # The replicas shut their engines down (placement groups, rank actors).
        deadline = time.monotonic() + 60
        while any(d.startswith(APP) for d in list_deployments()) and time.monotonic() < deadline:
            time.sleep(1)
        assert not any(d.startswith(APP) for d in list_deployments())


@pytest.fixture(scope="module")
def client(model_dir):
    """nnsight's client side: a meta-only model, no engine (nnsight's own VLLM cannot build one on CPU)."""
    from nnsight_ray import LocalVLLM

    return LocalVLLM(model_dir)


def on(served, **extra):
    return {"serve": served["url"], "api_key": KEY, **extra}


# --------------------------------------------------------------------------- readiness


def test_health_is_503_until_the_engine_is_ready_then_200(served):
    status, body = served["first_health"]
    assert status == 503 and "not ready" in body["detail"]
    ready = httpx.get(f"{served['url']}/health")
    assert ready.status_code == 200  # no key needed
    assert ready.json()["gc_frozen"] > 10_000  # the replica froze its startup heap (vLLM, torch, the client)
    assert len(registry_status(APP)["engines"]) == 2


# --------------------------------------------------------------------------- nnsight's client


def test_blocking_trace_matches_local(served, client, local_llama):
    got = layer_and_logits(client, "Hello world", **on(served))
    want = layer_and_logits(local_llama, "Hello world")
    for g, w in zip(got, want):
        assert_close(g, w)


def test_multi_invoke_with_an_edit_matches_local(served, client, local_llama):
    for got, want in zip(multi_invoke(client, **on(served)), multi_invoke(local_llama)):
        assert_close(got, want)


def test_non_blocking_trace_with_collect(served, client, local_llama):
    from nnsight_ray.serve.client import NonBlockingServe

    backends = [NonBlockingServe(client, served["url"], api_key=KEY) for _ in range(3)]
    tracers = []
    for prompt, backend in zip(["Hello world", "abc", "The quick brown fox"], backends):
        with client.trace(prompt, temperature=0.0, max_tokens=1, backend=backend) as tracer:
            hidden = client.model.layers[2].output[0].clone().save()
        tracers.append((prompt, tracer))
    for prompt, tracer in tracers:
        assert_close(tracer.collect(timeout=120)["hidden"], layer_and_logits(local_llama, prompt)[0])


def test_blocking_false_with_serve_runs_blocking_on_nnsight_0_8_1(served, client, local_llama):
    """nnsight ignores ``blocking=`` next to ``serve=`` (docs/serve.md): values arrive as for a blocking trace."""
    with client.trace("Hello world", temperature=0.0, max_tokens=1, blocking=False, **on(served)) as tracer:
        hidden = client.model.layers[2].output[0].clone().save()
    assert_close(hidden, layer_and_logits(local_llama, "Hello world")[0])
    assert not hasattr(tracer, "collect")


def test_sixteen_concurrent_clients_get_their_own_values(served, client, local_llama):
    prompts = [f"client {i} says " + "xyz"[: i % 4] for i in range(16)]
    want = {p: layer_and_logits(local_llama, p)[0][-1] for p in prompts}
    barrier = threading.Barrier(16)

    def one_client(prompt):
        barrier.wait(timeout=60)
        values = []
        for _ in range(2):
            with client.trace(prompt, temperature=0.0, max_tokens=1, **on(served)):
                hidden = client.model.layers[2].output[0][-1].clone().save()
            values.append(hidden)
        return values

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one_client, prompts, timeout=300))
    for prompt, values in zip(prompts, results):
        for value in values:
            assert_close(value, want[prompt])
    assert set(engine_request_counts(APP)) == {0}


# --------------------------------------------------------------------------- replicas, registered blocks, completions


def completions(served, prompt, return_saves=True, **extra):
    response = httpx.post(f"{served['url']}/v1/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                          json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                "nnsight": {"return_saves": return_saves}, **extra})
    assert response.status_code == 200, response.text
    return response


def test_registered_block_reaches_both_replicas_and_completions_carry_its_values(served, client, local_llama):
    from nnsight_ray.serve import decode_saves

    with client.edit(serve=served["url"], api_key=KEY) as (tracer, edit):
        registered = client.model.layers[2].output[0].clone().save()
    assert [r["id"] for r in registry_status(APP)["registrations"]] == [edit.id]
    try:
        prompts = ["Hello world", "abc def"]
        want = {p: layer_and_logits(local_llama, p)[0] for p in prompts}
        engines = set()
        # Serve's router picks the replica with the shorter queue as its proxy
        # last saw it, and keeps that figure for up to 10 s
        # (RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S): one stale entry sends every
        # request of a quick loop to the same replica. So the loop runs on the
        # clock, past that window, not for a count of requests.
        deadline = time.monotonic() + 60
        attempts = 0
        while time.monotonic() < deadline and (len(engines) < 2 or attempts < 4):
            response = completions(served, prompts)
            engines.add(response.headers["nnsight-engine"])
            saves = decode_saves(response.json()["nnsight_saves"])
            assert len(saves) == 2
            for prompt, values in zip(prompts, saves):
                assert_close(values["registered"], want[prompt])
            attempts += 1
            time.sleep(0.25)
        assert len(engines) == 2, f"only {engines} answered in {attempts} requests over 60 s"
    finally:
        edit.clear()
    assert registry_status(APP)["registrations"] == []
    for _ in range(6):
        assert decode_saves(completions(served, "Hello world").json()["nnsight_saves"]) == [{}]


def test_completions_match_local_generate_and_speak_openai(served, local_llama):
    openai = pytest.importorskip("openai")

    want = local_llama.generate("Hello world", max_tokens=4, temperature=0.0)[0].outputs[0].text
    api = openai.OpenAI(base_url=f"{served['url']}/v1", api_key=KEY, max_retries=0)
    result = api.completions.create(model="tiny", prompt=["Hello world", "abc"], max_tokens=4, temperature=0)
    assert result.object == "text_completion" and len(result.choices) == 2
    assert result.choices[0].text == want
    assert result.usage.completion_tokens == 8
    from nnsight_ray.serve import decode_saves

    asked = api.completions.create(model="tiny", prompt="abc", max_tokens=1, temperature=0,
                                   extra_body={"nnsight": {"return_saves": True}})
    assert decode_saves(asked.model_extra["nnsight_saves"]) == [{}]  # no block registered now
    bad = httpx.post(f"{served['url']}/v1/completions", headers={"ndif-api-key": KEY},
                     json={"prompt": "x", "echo": True})
    assert bad.status_code == 400 and "echo" in bad.json()["error"]["message"]


# --------------------------------------------------------------------------- security and bad requests


def test_wrong_or_missing_key_is_refused_and_nothing_runs(served, client):
    url = served["url"]
    for route in ("/v1/nnsight/generate", "/v1/nnsight/register/x", "/v1/nnsight/register/x/clear", "/v1/completions",
                  "/v1/chat/completions"):
        assert httpx.post(f"{url}{route}", content=b"{}").status_code == 401
        assert httpx.post(f"{url}{route}", content=b"{}", headers={"ndif-api-key": "wrong"}).status_code == 403
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 403
    big = httpx.post(f"{url}/v1/chat/completions", content=b"x" * (MAX_BODY + 1), headers={"ndif-api-key": KEY})
    assert big.status_code == 413
    with pytest.raises(ConnectionError, match="403"):
        layer_and_logits(client, "Hello", serve=url, api_key="wrong")
    with pytest.raises(ConnectionError, match="403"):
        with client.edit(serve=url, api_key="wrong") as (tracer, edit):
            client.model.layers[0].output[0].save()
    assert registry_status(APP)["registrations"] == []
    assert decode_only(completions(served, "Hello")) == [{}]


def decode_only(response):
    from nnsight_ray.serve import decode_saves

    return decode_saves(response.json()["nnsight_saves"])


def raw_generate(url: str, body, **headers):
    return httpx.post(f"{url}/v1/nnsight/generate", content=body, timeout=120,
                      headers={"ndif-api-key": KEY, "content-type": "application/octet-stream", **headers})


def test_bad_requests_fail_alone_while_others_succeed(served, client, local_llama):
    url = served["url"]
    want = layer_and_logits(local_llama, "Hello world")[0]

    def good():
        return layer_and_logits(client, "Hello world", **on(served))[0]

    def raising():
        with pytest.raises(Exception, match="IndexError|index"):
            with client.trace("Hello", temperature=0.0, max_tokens=1, **on(served)):
                client.model.layers[2].output[0][10_000].save()
        return "raised"

    def corrupt():
        response = raw_generate(url, b"\x80\x04 definitely not a trace")
        assert response.status_code == 200
        result = torch.load(io.BytesIO(response.content), weights_only=False)
        assert result["saves"] == {} and result["error"] is not None
        return result["error"]["type_name"]

    def oversized_declared():
        return raw_generate(url, b"x" * (MAX_BODY + 1)).status_code

    def oversized_streamed():
        return raw_generate(url, iter([b"y" * (MAX_BODY // 2)] * 3)).status_code

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good) for _ in range(4)]
        bads = [pool.submit(f) for f in (raising, corrupt, oversized_declared, oversized_streamed)]
        results = [f.result(timeout=300) for f in bads]
        for future in goods:
            assert_close(future.result(timeout=300), want)
    assert results[0] == "raised" and isinstance(results[1], str)
    assert results[2:] == [413, 413]
    assert "exceeds the limit" in raw_generate(url, b"x" * (MAX_BODY + 1)).json()["detail"]
    assert_close(good(), want)
    assert set(engine_request_counts(APP)) == {0}


def test_a_runaway_serve_trace_fails_alone_within_its_budget_and_neighbours_are_exact(served, client, local_llama):
    """A serve= tenant whose block spins holds no one: the engine stops it after the ``block_timeout_s`` its trace
    asked for (3 s; the app's default is 2 s), then her next traces are refused for a while (her cool-down)."""
    prompts = [f"neighbour {i}" for i in range(8)]
    want = {p: layer_and_logits(local_llama, p)[0] for p in prompts}

    def runaway():
        with pytest.raises(Exception, match="block_timeout_s=3 ") as raised:
            with client.trace("A runaway tenant", temperature=0.0, max_tokens=2, block_timeout_s=3.0,
                              **on(served, api_key=MALLORY)):
                client.model.layers[0].output[0].save()
                while True:
                    pass
        return str(raised.value)

    def neighbour(prompt):
        began = time.monotonic()
        value = layer_and_logits(client, prompt, **on(served))[0]
        return value, time.monotonic() - began

    with ThreadPoolExecutor(9) as pool:
        bad = pool.submit(runaway)
        time.sleep(0.5)
        goods = {p: pool.submit(neighbour, p) for p in prompts}
        for prompt, future in goods.items():
            value, waited = future.result(timeout=120)
            assert_close(value, want[prompt])
            assert waited < 3.0 + 5, f"{prompt!r} waited {waited:.1f} s"
        assert "BlockTimeoutError" in bad.result(timeout=120)
    assert set(engine_request_counts(APP)) == {0}
    # Her next trace, on either replica, is refused for 3 x the 3 s her block held the engine; others go on.
    with pytest.raises(ConnectionError, match="429.*tenant 'mallory'.*refused"):
        layer_and_logits(client, "Hello", **on(served, api_key=MALLORY))
    assert_close(layer_and_logits(client, prompts[0], **on(served))[0], want[prompts[0]])
    cool_down_over(served)


def cool_down_over(served, timeout_s=30):
    """Wait until mallory may send again (her cool-down is the application's)."""
    from ray import serve

    jobs = serve.get_deployment_handle("NNsightJobs", app_name=APP)
    deadline = time.monotonic() + timeout_s
    while jobs.tenant.remote("cooling_s", "mallory").result(timeout_s=30) > 0:
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_serve_routes_past_an_engine_a_remote_job_holds(served, client, local_llama):
    """A remote=True job returns at once, so its replica's queue looks empty while its block holds the
    engine (here up to its own block_timeout_s=8); Serve's router, reading each engine's step clock,
    sends new traces to the other replica meanwhile, so they do not wait for the stop."""
    from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

    prompts = [f"routed {i}" for i in range(4)]
    want = {p: layer_and_logits(local_llama, p)[0] for p in prompts}

    def runaway():
        backend = RemoteBackend(client.to_model_key(), host=served["url"], api_key=MALLORY)
        with pytest.raises(RemoteError, match="BlockTimeoutError") as raised:
            with client.trace("A runaway tenant", temperature=0.0, max_tokens=2, block_timeout_s=8.0,
                              backend=backend):
                client.model.layers[0].output[0].save()
                while True:
                    pass
        return str(raised.value)

    with ThreadPoolExecutor(1) as pool:
        began = time.monotonic()
        bad = pool.submit(runaway)
        time.sleep(3.5)  # stalled past stalled_after_s (1 s), and a routing-stats poll old
        for prompt in prompts:
            sent = time.monotonic()
            assert_close(layer_and_logits(client, prompt, **on(served))[0], want[prompt])
            assert time.monotonic() - sent < 2.0, f"{prompt!r} waited {time.monotonic() - sent:.1f} s"
        assert time.monotonic() - began < 7.5, "the neighbours ran after the stop: the test proves nothing"
        message = bad.result(timeout=120)
    assert "block_timeout_s=8 " in message  # the trace's own deadline, carried through remote=True
    assert set(engine_request_counts(APP)) == {0}
    cool_down_over(served, timeout_s=60)


# --------------------------------------------------------------------------- OpenAI's client: chat, streams, models, named edits


def openai_client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{served['url']}/v1", api_key=KEY, max_retries=0, timeout=120)


def local_probe(local_llama, prompt, max_tokens):
    """Text and the ``probe`` edit's saves of one plain request on the single-device engine."""
    with local_llama.edit(name="probe") as (tracer, edit):
        probe = local_llama.model.layers[2].output[0].clone().save()
    try:
        output = local_llama.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)[0]
    finally:
        edit.clear()
    return output.outputs[0].text, output.saves["probe"]


def test_openai_chat_streams_and_named_edits_match_local(served, client, local_llama, model_dir):
    """The unmodified OpenAI client: models, chat (plain and streamed), streamed completions; a named
    edit's saves and the generated text equal the single-device engine's."""
    from transformers import AutoTokenizer

    from nnsight_ray.serve import decode_saves

    api = openai_client(served)
    assert [m.id for m in api.models.list().data] == [model_dir]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    chat_ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    want_chat, want_chat_probe = local_probe(local_llama, {"prompt_token_ids": list(chat_ids)}, 4)
    want_text, want_probe = {}, {}
    for prompt in ("Hello world", "abc"):
        want_text[prompt], want_probe[prompt] = local_probe(local_llama, prompt, 4)

    with client.edit(name="probe", serve=served["url"], api_key=KEY) as (tracer, edit):
        probe = client.model.layers[2].output[0].clone().save()
    try:
        # A client that never heard of nnsight: plain chat, no nnsight fields.
        plain = api.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
        assert plain.choices[0].message.content == want_chat
        assert plain.usage.prompt_tokens == len(chat_ids) and plain.usage.completion_tokens == 4
        assert "nnsight_saves" not in (plain.model_extra or {})

        named = api.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True, "nnsight": {"edits": ["probe"]}})
        assert named.choices[0].message.content == want_chat
        (saves,) = decode_saves(named.model_extra["nnsight_saves"])
        assert_close(saves["probe"], want_chat_probe)
        assert named.model_extra["nnsight_errors"] == [None]

        stream = api.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True, "nnsight": {"edits": ["probe"]}})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        final = chunks[-1]
        assert final.choices == [] and final.usage.completion_tokens == 4
        assert_close(decode_saves(final.model_extra["nnsight_saves"])[0]["probe"], want_chat_probe)

        stream = api.completions.create(model="tiny", prompt=["Hello world", "abc"], max_tokens=4, temperature=0,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True, "nnsight": {"edits": ["probe"]}})
        chunks = list(stream)
        texts = {0: "", 1: ""}
        for chunk in chunks[:-1]:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == {0: want_text["Hello world"], 1: want_text["abc"]}
        assert chunks[-1].usage.completion_tokens == 8
        for saves, prompt in zip(decode_saves(chunks[-1].model_extra["nnsight_saves"]), ("Hello world", "abc")):
            assert_close(saves["probe"], want_probe[prompt])

        # An edit nobody registered: 400 naming it, nothing run; the next request is served.
        openai = pytest.importorskip("openai")
        with pytest.raises(openai.BadRequestError, match="no edit is registered.*'nope'|'nope'.*no edit"):
            api.completions.create(model="tiny", prompt="abc", max_tokens=1,
                                   extra_body={"nnsight": {"edits": ["probe", "nope"]}})
        again = api.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert again.choices[0].text == want_text["abc"]
    finally:
        edit.clear()
    assert registry_status(APP)["registrations"] == []
    assert set(engine_request_counts(APP)) == {0}


def test_metrics_move_under_load_on_rays_export_port(served, client):
    """Ray's export port on every raylet (``ray.nodes()``: ``MetricsExportPort``) shows the project's series
    move while the app serves traces, completions, a stream and a failing trace, and vLLM's own series (the
    replicas' engines have vLLM's stats on, as ``vllm serve``) beside them."""
    ports = export_ports()
    assert ports and all(ports)
    before = scrape(ports)
    api = openai_client(served)
    stop = threading.Event()

    def long_requests():  # keeps requests in flight while the gauge is polled
        while not stop.is_set():
            api.completions.create(model="tiny", prompt="load", max_tokens=200, temperature=0,
                                   extra_body={"ignore_eos": True})

    def plain_traced_load():
        layer_and_logits(client, "Hello world", **on(served))
        completions(served, ["Hello world", "abc"])
        list(api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=3, stream=True))
        with pytest.raises(Exception, match="IndexError|index"):
            with client.trace("Hello", temperature=0.0, max_tokens=1, **on(served)):
                client.model.layers[2].output[0][10_000].save()

    wanted = {
        "traced requests": lambda s: total(s, "ray_nnsight_request_latency_seconds_count", route="generate",
                                           kind="traced"),
        "completions": lambda s: total(s, "ray_nnsight_request_latency_seconds_count", route="completions",
                                       kind="plain", status="ok"),
        "chat": lambda s: total(s, "ray_nnsight_request_latency_seconds_count", route="chat"),
        "time to first token": lambda s: total(s, "ray_nnsight_time_to_first_token_seconds_count", route="chat"),
        "saved bytes": lambda s: total(s, "ray_nnsight_saved_bytes_total", route="completions"),
        "stash": lambda s: total(s, "ray_nnsight_collect_seconds_count", stage="stash"),
        "merge": lambda s: total(s, "ray_nnsight_collect_seconds_count", stage="merge"),
        "intervention errors": lambda s: total(s, "ray_nnsight_intervention_errors_total", route="generate",
                                               type="IndexError"),
        # vLLM's own series, from each replica's engine actor (its stats are on, as `vllm serve`'s).
        "vllm generation tokens": lambda s: total(s, "ray_vllm_generation_tokens_total"),
    }
    with ThreadPoolExecutor(3) as pool:
        loaders = [pool.submit(long_requests) for _ in range(2)]
        plain_traced_load()
        moved, in_flight_seen = set(), 0.0
        deadline = time.monotonic() + 90
        try:
            while time.monotonic() < deadline and (len(moved) < len(wanted) or in_flight_seen < 1):
                time.sleep(2)
                now = scrape(ports)
                moved |= {what for what, value in wanted.items() if value(now) > value(before)}
                in_flight_seen = max(in_flight_seen, total(now, "ray_nnsight_requests_in_flight", kind="plain"))
        finally:
            stop.set()
            for loader in loaders:
                loader.result(timeout=120)
    assert moved == set(wanted), f"series that did not move in 90 s: {sorted(set(wanted) - moved)}"
    assert in_flight_seen >= 1, "ray_nnsight_requests_in_flight{kind='plain'} never showed a request in flight"
    # Every series carries Ray's labels and the project's own.
    sample = next(s for s in scrape(ports) if s[0] == "ray_nnsight_requests_in_flight")
    assert {"route", "kind", "replica", "NodeAddress"} <= set(sample[1])


# --------------------------------------------------------------------------- a replica whose engine dies (last)


def test_a_killed_rank_fails_its_requests_and_serve_replaces_the_replica(served, client, local_llama):
    """Under load, one replica's rank dies: its requests (serve= and remote=True) fail fast naming the rank,
    check_health fails, Serve starts a new replica (a new engine), and requests succeed again on both.

    Last in the module: it replaces one of the application's engines.
    """
    from nnsight_ray._internal.deploy import list_deployments

    want = layer_and_logits(local_llama, "Hello world")[0]
    before = set(registry_status(APP)["engines"])
    victim = sorted(before)[0]
    rank = f"{victim}.pp0.tp0"
    stop = threading.Event()
    errors: list[tuple[float, str]] = []
    served_ok = []

    remote_errors: list[tuple[float, str]] = []

    def load(remote=False):
        from nnsight.intervention.backends.remote import RemoteBackend

        while not stop.is_set():
            how = ({"backend": RemoteBackend(client.to_model_key(), host=served["url"], api_key=KEY)} if remote
                   else on(served))
            try:
                with client.trace("Hello world", temperature=0.0, max_tokens=40, ignore_eos=True, **how):
                    client.model.layers[2].output[0].save()
                served_ok.append(time.monotonic())
            except Exception as error:  # noqa: BLE001 - recorded and asserted
                (remote_errors if remote else errors).append((time.monotonic(), str(error)))

    def running_on_victim() -> int:  # remote=True jobs not yet final on the victim's replica (its engine's name)
        from ray import serve

        stats = serve.get_deployment_handle("NNsightJobs", app_name=APP).call.remote("stats").result(timeout_s=30)
        return stats["running_on"].get(victim, 0)

    with ThreadPoolExecutor(6) as pool:  # four serve= clients, two remote=True (test_remote.py) clients
        loaders = [pool.submit(load) for _ in range(4)] + [pool.submit(load, True) for _ in range(2)]
        time.sleep(3.0)
        # Serve routes each request to either replica: kill while a remote job and a serve= request run on
        # the victim (else none need ever meet the dead rank; on a loaded machine the stall-aware router
        # may send every serve= request to the other replica for a while).
        victim_engine = ray.get_actor(f"{victim}.engine", namespace="nnsight_ray")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            jobs = running_on_victim()
            if jobs and ray.get(victim_engine.load.remote(), timeout=30)["in_flight"] > jobs:
                break
            time.sleep(0.05)
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(rank, namespace="nnsight_ray"))
        time.sleep(8.0)
        stop.set()
        for loader in loaders:
            loader.result(timeout=120)
    assert errors, "no request was in flight on the killed engine"
    for at, message in errors:
        assert at - killed_at < 10 and rank in message and "the engine is dead" in message, message
    assert remote_errors, "no remote=True job ran on the killed engine"
    for at, message in remote_errors:  # RemoteError: the job ended in ERROR, or its POST was refused (503)
        assert at - killed_at < 10 and rank in message, message
    # The failing health check makes Serve replace the replica, with an engine of a new name.
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        engines = set(registry_status(APP)["engines"])
        if len(engines) == 2 and victim not in engines:
            break
        assert time.monotonic() < deadline, f"replica not replaced: {engines}"
        time.sleep(2)
    for _ in range(4):  # both replicas serve, values as the single-device engine's
        assert_close(layer_and_logits(client, "Hello world", **on(served))[0], want)
    assert victim not in list_deployments()


def test_a_block_stuck_past_its_grace_fail_stops_its_engine_and_serve_replaces_the_replica(served, client,
                                                                                           local_llama):
    """A block in one C call that never returns (a 60 s sleep) cannot be stopped: 3 s (block_stop_grace_s) after
    its 2 s budget its rank ends itself, its caller hears why, and Serve replaces the replica within one engine
    start while the other replica serves on."""
    want = layer_and_logits(local_llama, "Hello world")[0]
    before = set(registry_status(APP)["engines"])
    began = time.monotonic()
    with pytest.raises(Exception, match="did not stop") as stuck:
        with client.trace("A stuck tenant", temperature=0.0, max_tokens=2, **on(served, api_key=MALLORY)):
            client.model.layers[0].output[0].save()
            import time as clock

            clock.sleep(60)
    assert time.monotonic() - began < 2.0 + 3.0 + 10, "the caller was not told within the grace"
    assert "block_stop_grace_s=3" in str(stuck.value)
    # The other replica serves. Until the router's next routing-stats poll marks the dead engine's replica
    # (docs/serve.md), a request may still be routed there and fail naming the dead engine: a client retries.
    deadline = time.monotonic() + 30
    while True:
        try:
            assert_close(layer_and_logits(client, "Hello world", **on(served))[0], want)
            break
        except Exception as error:  # noqa: BLE001 - only the dead engine's refusal is retried
            if "dead" not in str(error).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        engines = set(registry_status(APP)["engines"])
        if len(engines) == 2 and len(engines & before) == 1:
            break
        assert time.monotonic() < deadline, f"replica not replaced: {engines}"
        time.sleep(2)
    for _ in range(4):
        assert_close(layer_and_logits(client, "Hello world", **on(served))[0], want)
