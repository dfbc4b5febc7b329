"""``nnsight_ray.serve`` without Ray: the gate, the arguments, the registry, the wire shapes.

The API-key and body-size gate runs as the plain ASGI middleware it is, in
front of a tiny Starlette app, through Starlette's test client. No test here
starts or joins Ray: ``ray.init`` raises.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from nnsight_ray.serve import ServeArgs, ServeArgsError, build_app, decode_saves
from nnsight_ray.serve.protocol import CompletionRequest, completion_response, encode_saves, trace_payload
from nnsight_ray.serve.registry import RegistrationError, Registry
from nnsight_ray.serve.job_store import TenantsClient
from nnsight_ray.serve.security import GuardMiddleware, check_api_key, declared_length, presented_key, route_path


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("unit tests must not start or join Ray")

    monkeypatch.setattr(ray, "init", refuse)


# --------------------------------------------------------------------------- API key


def headers(**values: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in values.items()]


def test_no_key_configured_lets_everything_through():
    assert check_api_key(headers(), None) is None


def test_missing_key_is_401_and_wrong_key_403():
    assert check_api_key(headers(), "s3cret")[0] == 401
    assert check_api_key(headers(ndif_api_key="nope"), "s3cret")[0] == 403
    assert check_api_key(headers(ndif_api_key="s3cret"), "s3cret") is None


def test_bearer_token_is_accepted_for_openai_clients():
    assert presented_key(headers(authorization="Bearer s3cret")) == b"s3cret"
    assert check_api_key(headers(authorization="Bearer s3cret"), "s3cret") is None
    assert check_api_key(headers(authorization="Basic s3cret"), "s3cret")[0] == 401
    # nnsight's header wins over Authorization.
    assert check_api_key(headers(ndif_api_key="s3cret", authorization="Bearer x"), "s3cret") is None


def test_key_is_compared_in_constant_time(monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    check_api_key(headers(ndif_api_key="guess"), "s3cret")
    assert calls == [(b"guess", b"s3cret")]


def test_declared_length_and_route_path():
    assert declared_length(headers()) is None
    assert declared_length(headers(content_length="12")) == 12
    assert declared_length(headers(content_length="twelve")) == -1
    assert declared_length(headers(content_length="-3")) == -1
    assert route_path({"path": "/nnsight/health", "root_path": "/nnsight"}) == "/health"
    assert route_path({"path": "/health", "root_path": ""}) == "/health"


# --------------------------------------------------------------------------- the gate, as ASGI


@pytest.fixture
def guarded():
    """A Starlette app behind the gate (key "s3cret", 1000-byte limit) and what its handlers saw."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    seen: list[int] = []

    async def echo(request):
        body = await request.body()
        seen.append(len(body))
        return JSONResponse({"bytes": len(body)})

    async def health(request):
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/v1/nnsight/generate", echo, methods=["POST"]),
                            Route("/health", health)])
    app.add_middleware(GuardMiddleware, api_key="s3cret", max_body_bytes=1000)
    return TestClient(app), seen


def test_gate_refuses_before_the_handler_runs(guarded):
    client, seen = guarded
    assert client.post("/v1/nnsight/generate", content=b"x").status_code == 401
    response = client.post("/v1/nnsight/generate", content=b"x", headers={"ndif-api-key": "wrong"})
    assert response.status_code == 403 and response.json()["detail"] == "invalid API key"
    assert seen == []
    assert client.post("/v1/nnsight/generate", content=b"x", headers={"ndif-api-key": "s3cret"}).json() == {"bytes": 1}
    assert seen == [1]


def test_health_needs_no_key(guarded):
    client, _ = guarded
    assert client.get("/health").status_code == 200


def test_declared_oversize_body_is_413_without_reading(guarded):
    client, seen = guarded
    response = client.post("/v1/nnsight/generate", content=b"x" * 1001, headers={"ndif-api-key": "s3cret"})
    assert response.status_code == 413 and "1000 bytes" in response.json()["detail"]
    assert seen == []


def test_streamed_body_is_counted_and_cut_at_the_limit(guarded):
    client, seen = guarded

    def chunks():  # no Content-Length: chunked transfer
        for _ in range(5):
            yield b"y" * 300

    response = client.post("/v1/nnsight/generate", content=chunks(), headers={"ndif-api-key": "s3cret"})
    assert response.status_code == 413
    assert seen == []
    ok = client.post("/v1/nnsight/generate", content=iter([b"z" * 500, b"z" * 500]),
                     headers={"ndif-api-key": "s3cret"})
    assert ok.json() == {"bytes": 1000}


def test_malformed_content_length_is_400():
    async def app(scope, receive, send):  # pragma: no cover - never reached
        raise AssertionError

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    gate = GuardMiddleware(app, api_key=None, max_body_bytes=10)
    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"content-length", b"abc")]}
    asyncio.run(gate(scope, receive, send))
    assert sent[0]["status"] == 400


# --------------------------------------------------------------------------- arguments


def test_args_from_the_command_line_are_coerced():
    args = ServeArgs.parse({"model": "/m", "tensor_parallel_size": "2", "pipeline_parallel_size": "2",
                            "num_replicas": "3", "engine_kwargs": '{"max_model_len": 256}'})
    assert (args.world_size, args.num_replicas, args.engine_kwargs) == (4, 3, {"max_model_len": 256})
    assert args.engine_options() == {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                     "placement_strategy": "PACK", "usage_context": "OPENAI_API_SERVER",
                                     "max_model_len": 256}


@pytest.mark.parametrize("bad,needle", [
    ({}, "model"),
    ({"model": "/m", "tp": 2}, "tp"),
    ({"model": "/m", "tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"model": "/m", "placement_strategy": "PACKED"}, "placement_strategy"),
    ({"model": "/m", "max_body_bytes": 0}, "max_body_bytes"),
    ({"model": "/m", "engine_kwargs": "{not json"}, "not JSON"),
    ({"model": "/m", "engine_kwargs": {"tensor_parallel_size": 2}}, "build_app arguments instead"),
    ({"model": "/m", "engine_kwargs": {"block_timeout_s": 900}}, "above max_block_timeout_s=600"),
])
def test_bad_args_are_refused_with_the_known_keys(bad, needle):
    with pytest.raises(ServeArgsError, match="Known arguments") as info:
        ServeArgs.parse(bad)
    assert needle in str(info.value)


def test_api_key_from_argument_then_environment():
    assert ServeArgs.parse({"model": "/m"}).resolved_api_key({}) is None
    assert ServeArgs.parse({"model": "/m"}).resolved_api_key({"NNSIGHT_RAY_API_KEY": "env"}) == "env"
    args = ServeArgs.parse({"model": "/m", "api_key": "k3y-from-arg"})
    assert args.resolved_api_key({"NNSIGHT_RAY_API_KEY": "env"}) == "k3y-from-arg"
    assert "k3y-from-arg" not in repr(args)  # a SecretStr: never logged


def test_the_documented_config_arguments_are_accepted():
    from test_cluster_configs import SERVE_ARGS

    assert SERVE_ARGS <= set(ServeArgs.model_fields)


def test_build_app_binds_the_replica_its_registry_and_its_jobs(monkeypatch):
    monkeypatch.setenv("NNSIGHT_RAY_API_KEY", "from-env")
    app = build_app({"model": "/m", "num_replicas": 2, "result_ttl_s": 30})
    deployment = app._bound_deployment
    assert deployment.name == "NNsightDeployment" and deployment.num_replicas == 2
    args, registry, jobs = deployment.init_args
    assert args.resolved_api_key({}) == "from-env"
    assert registry._bound_deployment.name == "NNsightRegistry"
    assert jobs._bound_deployment.name == "NNsightJobs"
    assert jobs._bound_deployment.init_args[0].result_ttl_s == 30
    with pytest.raises(ServeArgsError):
        build_app({"model": "/m", "nope": 1})


def test_graph_modes_pass_through_engine_kwargs_and_contradictions_are_refused():
    args = ServeArgs.parse({"model": "/m", "engine_kwargs": '{"taps": ["model.layers.*.output"]}'})
    assert args.engine_kwargs == {"taps": ["model.layers.*.output"]}
    with pytest.raises(ServeArgsError, match="contradicts taps"):
        ServeArgs.parse({"model": "/m", "engine_kwargs": {"taps": ["model.layers.*.output"], "enforce_eager": True}})


# --------------------------------------------------------------------------- registry


class FakeEngines:
    """Engines as the registry sees them: installed ids per engine, some dead, some refusing."""

    def __init__(self, *names: str) -> None:
        self.installed = {n: {} for n in names}
        self.dead: set[str] = set()
        self.refuse: set[str] = set()

    async def rpc(self, engine: str, method: str, args: tuple):
        if engine in self.dead:
            raise ConnectionError(f"{engine} is gone")
        if method == "nnsight_register":
            if engine in self.refuse:
                raise ValueError("cannot deserialize")
            id, payload, name = args
            self.installed[engine][id] = (name, payload)
        else:
            self.installed[engine].pop(args[0], None)
        return [None]


def registry(engines: FakeEngines) -> Registry:
    return Registry(engines.rpc, lambda error: isinstance(error, ConnectionError))


def test_register_reaches_every_engine_and_new_ones_replay():
    async def run():
        engines = FakeEngines("a", "b", "c")
        reg = registry(engines)
        await reg.attach("a")
        await reg.attach("b")
        await reg.register("r1", None, b"one")
        await reg.register("r2", "named", b"two")
        assert engines.installed["a"] == engines.installed["b"] == {"r1": (None, b"one"), "r2": ("named", b"two")}
        replay = await reg.attach("c")  # a replica that started later
        assert replay == {"engine": "c", "replayed": 2, "failed": []}
        assert list(engines.installed["c"]) == ["r1", "r2"]
        await reg.clear("r1")
        assert all(list(v) == ["r2"] for v in engines.installed.values())
        await reg.clear("unknown")  # a no-op, as on one engine
        assert reg.status()["registrations"] == [{"id": "r2", "name": "named", "bytes": 3}]

    asyncio.run(run())


def test_a_refused_install_is_rolled_back_everywhere():
    async def run():
        engines = FakeEngines("a", "b")
        reg = registry(engines)
        await reg.attach("a")
        await reg.attach("b")
        engines.refuse.add("b")
        with pytest.raises(RegistrationError, match="engine b refused"):
            await reg.register("bad", None, b"garbage")
        assert engines.installed == {"a": {}, "b": {}}
        assert reg.status()["registrations"] == []

    asyncio.run(run())


def test_dead_engines_are_detached_not_reported():
    async def run():
        engines = FakeEngines("a", "b")
        reg = registry(engines)
        await reg.attach("a")
        await reg.attach("b")
        engines.dead.add("b")
        assert (await reg.register("r", None, b"p"))["engines"] == 1
        assert reg.status()["engines"] == ["a"]

    asyncio.run(run())


def test_concurrent_operations_do_not_interleave():
    async def run():
        engines = FakeEngines("a", "b")
        order = []
        real = engines.rpc

        async def slow(engine, method, args):
            order.append(("start", method, args[0]))
            await asyncio.sleep(0.01)
            result = await real(engine, method, args)
            order.append(("end", method, args[0]))
            return result

        reg = Registry(slow, lambda e: False)
        await reg.attach("a")
        await asyncio.gather(reg.register("r", None, b"p"), reg.attach("b"), reg.clear("r"))
        assert engines.installed == {"a": {}, "b": {}}

    asyncio.run(run())


# --------------------------------------------------------------------------- wire shapes


def test_trace_payload_is_what_nnsights_client_loads():
    import io

    blob = trace_payload({"h": torch.ones(2)}, None)
    loaded = torch.load(io.BytesIO(blob), weights_only=False)
    assert set(loaded) == {"saves", "error"} and torch.equal(loaded["saves"]["h"], torch.ones(2))


def test_completion_request_parsing():
    request = CompletionRequest.model_validate({"prompt": ["a", [1, 2]], "max_tokens": 3, "temperature": 0,
                                                "stop": "x", "user": "someone",
                                                "nnsight": {"return_saves": True, "edits": ["e"]}})
    assert request.prompts() == ["a", {"prompt_token_ids": [1, 2]}]
    assert CompletionRequest.model_validate({"prompt": [5, 6]}).prompts() == [{"prompt_token_ids": [5, 6]}]
    assert CompletionRequest.model_validate({"prompt": "a", "stream": True}).stream
    for bad in ({"prompt": "a", "stream": True, "n": 2}, {"prompt": "a", "echo": True}, {"prompt": "a", "best_of": 2},
                {"prompt": "a", "logprobs": 1},
                {"prompt": "a", "max_tokens": -1}, {}, {"prompt": "a", "nnsight": {"return": 1}}):
        with pytest.raises(Exception):
            CompletionRequest.model_validate(bad)


def test_completion_response_shape_and_saves():
    def output(prompt_ids, texts, saves, per_sequence=None):
        completions = []
        for i, text in enumerate(texts):
            completion = SimpleNamespace(index=i, text=text, token_ids=[1] * len(text), finish_reason="length")
            if per_sequence is not None:
                completion.saves = per_sequence[i]
            completions.append(completion)
        return SimpleNamespace(prompt_token_ids=prompt_ids, outputs=completions, saves=saves, nnsight_error=None)

    outputs = [output([1, 2], ["ab"], {"h": torch.zeros(1)}),
               output([3], ["c", "d"], {"h": torch.ones(1)}, per_sequence=[{"h": torch.ones(1)}, {"h": torch.full((1,), 2.0)}])]
    response = completion_response(outputs, "tiny", return_saves=True)
    assert response["object"] == "text_completion" and response["model"] == "tiny"
    assert [c["text"] for c in response["choices"]] == ["ab", "c", "d"]
    assert [c["index"] for c in response["choices"]] == [0, 1, 2]
    assert response["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    saves = decode_saves(response["nnsight_saves"])
    assert [float(s["h"]) for s in saves] == [0.0, 1.0, 2.0]
    assert response["nnsight_errors"] == [None, None, None]
    json.dumps(response)
    assert "nnsight_saves" not in completion_response(outputs, "tiny", return_saves=False)


def test_saves_round_trip():
    assert decode_saves(encode_saves([{"a": [1, 2]}, {}])) == [{"a": [1, 2]}, {}]
    x = torch.arange(6.0).reshape(2, 3)
    saved = [{"h": x[1], "nested": {"k": (x, None)}, "b": torch.ones(2, dtype=torch.bfloat16), "odd": object()},
             {"h": x[0]}]
    got = decode_saves(encode_saves(saved))
    assert torch.equal(got[0]["h"], x[1]) and torch.equal(got[1]["h"], x[0])
    assert torch.equal(got[0]["nested"]["k"][0], x) and got[0]["nested"]["k"][1] is None
    assert got[0]["b"].dtype == torch.bfloat16
    assert got[0]["odd"]["unsupported"] == "object" and "object" in got[0]["odd"]["repr"]


def test_saves_are_a_safetensors_file_any_language_reads():
    """base64 -> 8-byte header length, JSON header, raw bytes: no pickle (docs/serve.md, "Saved values")."""
    import base64
    import struct

    from safetensors.torch import load

    blob = base64.b64decode(encode_saves([{"probe": torch.tensor([1.0, 2.0])}, {"probe": torch.tensor([3.0])}]))
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + size])
    assert header["__metadata__"]["format"] == "nnsight-saves/1"
    assert json.loads(header["__metadata__"]["saves"]) == [{"probe": {"tensor": "0/probe"}},
                                                          {"probe": {"tensor": "1/probe"}}]
    assert header["0/probe"]["dtype"] == "F32" and header["0/probe"]["shape"] == [2]
    assert load(blob)["1/probe"].tolist() == [3.0]
    assert b"torch" not in blob and b"\x80\x04" not in blob  # no pickle inside
    with pytest.raises(ValueError, match="nnsight-saves/1"):
        from safetensors.torch import save

        decode_saves(base64.b64encode(save({"x": torch.ones(1)})).decode())


# --------------------------------------------------------------------------- the replica's routes, without Serve


class _Awaitable:
    """Stands in for a Ray ObjectRef / Serve DeploymentResponse: awaited once."""

    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def __await__(self):
        if self.error is not None:
            raise self.error
        return self.value
        yield  # pragma: no cover


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        try:
            return _Awaitable(self.fn(*args))
        except Exception as error:
            return _Awaitable(error=error)


def replica(state="ready", api_key=None, engine=None, registry=None, model_dir=None):
    """An ``NNsightDeployment`` instance built by hand (no Serve, no engine) and a client for its app."""
    from starlette.testclient import TestClient

    from nnsight_ray.serve.deployment import NNsightDeployment

    cls = NNsightDeployment.func_or_class
    obj = cls.__new__(cls)
    obj.args = ServeArgs.parse({"model": model_dir or "/m", "max_body_bytes": 4096,
                                "engine_kwargs": {"max_model_len": 256, "dtype": "float32"}})
    obj.api_key, obj.engine_name, obj.state, obj.error = api_key, "app-replica", state, None
    obj.tenants = TenantsClient(None, on=False)
    if state == "failed":
        obj.error = "PlacementError: no room"
    tokenizer = None
    if model_dir is not None:
        from vllm.tokenizers import cached_tokenizer_from_config

        obj._chat_model_config = _model_config(model_dir)
        tokenizer = cached_tokenizer_from_config(obj._chat_model_config)
    obj.model = SimpleNamespace(interleaver=SimpleNamespace(cancel=lambda: None), tokenizer=tokenizer)
    obj.persistent_objects = {}
    obj.engine, obj.registry = engine, registry
    return TestClient(obj.__serve_build_asgi_app__())


def test_replica_answers_503_until_its_engine_is_ready():
    from nnsight.modeling.vllm.serve import http

    client = replica(state="starting")
    response = client.get("/health")
    assert response.status_code == 503 and "not ready" in response.json()["detail"]
    generate = client.post("/v1/nnsight/generate", content=b"x")
    with pytest.raises(ConnectionError, match="503"):  # what nnsight's client raises
        http.check(generate)
    failed = replica(state="failed").get("/health")
    assert failed.status_code == 503 and "PlacementError" in failed.json()["detail"]
    health = replica().get("/health").json()
    assert health == {"status": "ok", "engine": "app-replica", "gc_frozen": health["gc_frozen"]}


def test_corrupt_trace_comes_back_as_the_traces_error():
    import io

    response = replica().post("/v1/nnsight/generate", content=b"\x80\x04 not a trace")
    assert response.status_code == 200 and response.headers["nnsight-engine"] == "app-replica"
    assert response.headers["server-timing"].startswith("build;dur=")
    result = torch.load(io.BytesIO(response.content), weights_only=False)
    assert result["saves"] == {} and result["error"]["type_name"]


def test_routes_are_guarded_and_limited():
    client = replica(api_key="k")
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 401
    assert client.post("/v1/completions", json={"prompt": "a"}, headers={"ndif-api-key": "x"}).status_code == 403
    big = client.post("/v1/nnsight/register/r", content=b"x" * 5000, headers={"ndif-api-key": "k"})
    assert big.status_code == 413


def test_completions_route_shapes_and_errors():
    from vllm import SamplingParams

    seen = []

    def generate_async(prompts, params):
        seen.append((prompts, params))
        completion = SimpleNamespace(index=0, text="xyz", token_ids=[1, 2, 3], finish_reason="length")
        return _Awaitable([SimpleNamespace(prompt_token_ids=[1], outputs=[completion], saves={"h": 1},
                                           nnsight_error=None) for _ in prompts])

    client = replica(engine=SimpleNamespace(generate_async=generate_async), registry=registry_of("probe"))
    ok = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3, "temperature": 0,
                                              "nnsight": {"edits": ["probe"]}})
    assert ok.status_code == 200 and [c["text"] for c in ok.json()["choices"]] == ["xyz", "xyz"]
    assert decode_saves(ok.json()["nnsight_saves"]) == [{"h": 1}, {"h": 1}]
    prompts, params = seen[0]
    assert prompts == ["a", "b"] and isinstance(params, SamplingParams)
    assert (params.max_tokens, params.temperature, params.extra_args) == (3, 0.0, {"nnsight_edits": ["probe"]})
    bad = client.post("/v1/completions", json={"prompt": "a", "stream": True, "n": 2})
    assert bad.status_code == 400 and "n > 1 with stream" in bad.json()["error"]["message"]
    assert bad.json()["error"]["type"] == "invalid_request_error" and bad.json()["error"]["code"] == 400
    assert client.post("/v1/completions", content=b"{not json").status_code == 400
    unknown = client.post("/v1/completions", json={"prompt": "a", "nnsight": {"edits": ["probe", "nope"]}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "nnsight.edits"
    assert "['nope']" in unknown.json()["error"]["message"] and "registered: ['probe']" in unknown.json()["error"]["message"]
    assert len(seen) == 1  # neither bad request reached the engine
    plain = client.post("/v1/completions", json={"prompt": "a"}).json()
    assert "nnsight_saves" not in plain and plain["choices"][0]["text"] == "xyz"

    from nnsight_ray.errors import RequestError

    failing = replica(engine=SimpleNamespace(
        generate_async=lambda p, s: _Awaitable(error=RequestError("prompt longer than max_model_len"))))
    refused = failing.post("/v1/completions", json={"prompt": "a"})
    assert refused.status_code == 400 and "max_model_len" in refused.json()["error"]["message"]


def test_register_and_clear_go_through_the_registry():
    calls = []

    def register(id, name, payload):
        calls.append(("register", id, name, payload))
        if payload == b"bad":
            raise RegistrationError("engine e refused registration r: cannot deserialize")
        return {"id": id}

    registry = SimpleNamespace(register=_Method(register),
                               clear=_Method(lambda id: calls.append(("clear", id)) or {"id": id}))
    client = replica(registry=registry)
    ok = client.post("/v1/nnsight/register/r1?name=probe", content=b"payload")
    assert ok.json() == {"status": "ok", "id": "r1", "name": "probe"}
    refused = client.post("/v1/nnsight/register/r2", content=b"bad")
    assert refused.status_code == 400 and "cannot deserialize" in refused.json()["detail"]
    assert client.post("/v1/nnsight/register/r1/clear").json() == {"status": "ok", "id": "r1"}
    assert calls == [("register", "r1", "probe", b"payload"), ("register", "r2", None, b"bad"), ("clear", "r1")]


def registry_of(*names):
    """A registry whose registrations carry ``names`` (for the edit-name check)."""
    registrations = [{"id": f"r{i}", "name": name, "bytes": 1} for i, name in enumerate(names)]
    return SimpleNamespace(status=_Method(lambda: {"engines": ["e"], "registrations": registrations}))


# --------------------------------------------------------------------------- OpenAI: streams, chat, models


def _output(text, tokens, finished, saves=None, error=None, prompt_ids=(1, 2)):
    completion = SimpleNamespace(index=0, text=text, token_ids=[7] * tokens,
                                 finish_reason="length" if finished else None)
    return SimpleNamespace(prompt_token_ids=list(prompt_ids), outputs=[completion], finished=finished,
                           saves=saves or {}, nnsight_error=error)


class StreamingEngine:
    """Stands in for ``RemoteEngine``'s stream surface: per prompt, the steps given, then the finished output."""

    def __init__(self, steps_of, fail_first=None):
        self.steps_of, self.fail_first = steps_of, fail_first
        self.started, self.finals = [], {}

    def stream(self, prompt, param, lora=None):
        group = f"g{len(self.started)}"
        self.started.append((prompt, param))
        steps = self.steps_of(prompt)
        self.finals[group] = steps[-1]

        async def generator():
            if self.fail_first is not None:
                raise self.fail_first
            for step in steps:
                yield _Awaitable(step)

        return group, generator()

    async def finished_output(self, group):
        return self.finals[group]

    def unwrap(self, error):
        return error


def events(response):
    """The ``data:`` payloads of a server-sent-event body, JSON-decoded (``[DONE]`` as the string)."""
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_streamed_completions_are_openai_chunks_then_usage_and_saves_then_done():
    def steps(prompt):
        return [_output("He", 2, False), _output("llo", 3, True, saves={"probe": torch.ones(2)})]

    engine = StreamingEngine(steps)
    client = replica(engine=engine, registry=registry_of("probe"))
    response = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 5, "stream": True,
                                                    "stream_options": {"include_usage": True},
                                                    "nnsight": {"edits": ["probe"]}})
    assert response.status_code == 200
    chunks = events(response)
    assert chunks[-1] == "[DONE]"
    body, final = chunks[:-2], chunks[-2]
    for chunk in body:
        assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-") and chunk["model"] == "/m"
        assert len(chunk["choices"]) == 1
    for index in (0, 1):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == "Hello"
        assert [c.get("finish_reason") for c in mine] == [None, "length"]
    assert final["choices"] == [] and final["usage"] == {"prompt_tokens": 4, "completion_tokens": 10,
                                                         "total_tokens": 14}
    assert [s["probe"].tolist() for s in decode_saves(final["nnsight_saves"])] == [[1.0, 1.0]] * 2
    assert final["nnsight_errors"] == [None, None]
    assert len({c["id"] for c in chunks[:-1]}) == 1
    _, params = engine.started[0]
    from vllm.sampling_params import RequestOutputKind

    assert params.output_kind == RequestOutputKind.DELTA and params.extra_args == {"nnsight_edits": ["probe"]}


def test_a_plain_stream_has_no_closing_chunk_and_a_refused_one_is_a_400():
    client = replica(engine=StreamingEngine(lambda p: [_output("x", 1, True)]))
    chunks = events(client.post("/v1/completions", json={"prompt": "a", "stream": True}))
    assert chunks[-1] == "[DONE]" and len(chunks) == 2 and chunks[0]["choices"][0]["text"] == "x"

    from nnsight_ray.errors import RequestError

    refused = replica(engine=StreamingEngine(lambda p: [_output("x", 1, True)],
                                             fail_first=RequestError("prompt longer than max_model_len")))
    response = refused.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]


def test_an_intervention_error_reaches_the_final_chunk_and_the_metrics():
    error = {"type_name": "IndexError", "message": "index 9 is out of bounds", "is_control_flow": False}
    recorded = Recorder()
    from nnsight_ray._internal.observe import metrics

    previous = metrics.use_backend(recorded)
    try:
        client = replica(engine=StreamingEngine(lambda p: [_output("x", 1, True, error=error)]))
        chunks = events(client.post("/v1/completions", json={"prompt": "a", "stream": True,
                                                              "nnsight": {"return_saves": True}}))
    finally:
        metrics.use_backend(previous)
    assert chunks[-2]["nnsight_errors"] == ["IndexError: index 9 is out of bounds"]
    assert ("nnsight_intervention_errors", 1.0, {"route": "completions", "type": "IndexError"}) in recorded.calls
    assert any(name == "nnsight_time_to_first_token_seconds" for name, _, _ in recorded.calls)
    latency = [tags for name, _, tags in recorded.calls if name == "nnsight_request_latency_seconds"]
    assert latency == [{"route": "completions", "kind": "plain", "status": "ok"}]
    flight = [(value, tags["kind"]) for name, value, tags in recorded.calls if name == "nnsight_requests_in_flight"]
    assert flight == [(1.0, "plain"), (0.0, "plain")]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from nnsight_ray.models import build_model

    return str(build_model(tmp_path_factory.mktemp("serve-unit-llama"), arch="llama", seed=0))


_configs: dict = {}


def _model_config(path):
    if path not in _configs:
        from vllm.engine.arg_utils import EngineArgs

        _configs[path] = EngineArgs(model=path, max_model_len=256, dtype="float32").create_model_config()
    return _configs[path]


def test_chat_uses_the_checkpoints_template_and_vllms_sampling_params(tiny_dir):
    from transformers import AutoTokenizer

    from nnsight_ray.serve.openai_api import ChatRequest, chat_prompt

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    request = ChatRequest.model_validate({"messages": messages, "max_completion_tokens": 4, "temperature": 0,
                                          "nnsight": {"edits": ["probe"]}})
    prompt, params = chat_prompt(request, _model_config(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir))
    want = AutoTokenizer.from_pretrained(tiny_dir).apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=True, add_generation_prompt=True, return_dict=False)
    assert prompt == {"prompt_token_ids": list(want)}
    assert (params.max_tokens, params.temperature, params.extra_args) == (4, 0.0, {"nnsight_edits": ["probe"]})
    unbounded = ChatRequest.model_validate({"messages": messages})
    _, params = chat_prompt(unbounded, _model_config(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir))
    assert params.max_tokens == 256 - len(want)  # what is left of the context, as under vllm serve


@pytest.mark.parametrize("extra, needle", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tools"),
    ({"logprobs": True}, "logprobs"),
    ({"stream": True, "n": 2}, "n > 1 with stream"),
    ({"nnsight": {"return": True}}, "nnsight"),
    ({"messages": "hello"}, "messages"),
])
def test_chat_requests_this_server_cannot_honour_are_refused(extra, needle):
    from nnsight_ray.serve.openai_api import ChatRequest, validation_message

    with pytest.raises(Exception) as raised:
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **extra})
    assert needle in validation_message(raised.value)


def test_chat_route_answers_and_streams_as_openai(tiny_dir):
    finished = _output("Hi!", 3, True, saves={"probe": torch.zeros(1)})
    engine = StreamingEngine(lambda p: [_output("Hi", 2, False), _output("!", 1, True,
                                                                          saves={"probe": torch.zeros(1)})])
    engine.generate_async = lambda prompts, params: _Awaitable([finished])
    client = replica(engine=engine, model_dir=tiny_dir)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0}
    reply = client.post("/v1/chat/completions", json={**body, "nnsight": {"return_saves": True}}).json()
    assert reply["object"] == "chat.completion" and reply["model"] == "tiny"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
    assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 3
    assert decode_saves(reply["nnsight_saves"])[0]["probe"].tolist() == [0.0]

    chunks = events(client.post("/v1/chat/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}}))
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2]) == "Hi!"
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 3
    assert "nnsight_saves" not in chunks[-2] and chunks[-1] == "[DONE]"
    prompt, _ = engine.started[0]
    assert set(prompt) == {"prompt_token_ids"}

    bad = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 300}]})
    assert bad.status_code == 400 and "context length" in bad.json()["error"]["message"]


def test_models_lists_the_checkpoint():
    client = replica(api_key="k")
    assert client.get("/v1/models").status_code == 401
    listed = client.get("/v1/models", headers={"authorization": "Bearer k"}).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["/m"]
    assert listed["data"][0]["object"] == "model" and listed["data"][0]["max_model_len"] == 256


def test_openai_routes_answer_503_in_openais_shape_until_ready():
    client = replica(state="starting")
    for route in ("/v1/completions", "/v1/chat/completions"):
        response = client.post(route, json={"prompt": "a"})
        assert response.status_code == 503 and "not ready" in response.json()["error"]["message"]


# --------------------------------------------------------------------------- metrics


class Recorder:
    def __init__(self):
        self.calls = []

    def record(self, metric, value, tags):
        self.calls.append((metric.name, value, tags))


def test_every_metric_is_named_tagged_and_exported_as_ray_does():
    from nnsight_ray._internal.observe.metrics import METRICS, exported_names

    assert set(METRICS) == {"nnsight_requests_in_flight", "nnsight_request_latency_seconds",
                            "nnsight_time_to_first_token_seconds", "nnsight_saved_bytes", "nnsight_collect_seconds",
                            "nnsight_intervention_errors", "nnsight_engine_deaths", "nnsight_data_rows",
                            "nnsight_data_batch_seconds", "nnsight_data_batches_in_flight"}
    assert exported_names("nnsight_saved_bytes") == ["ray_nnsight_saved_bytes_total"]
    assert exported_names("nnsight_requests_in_flight") == ["ray_nnsight_requests_in_flight"]
    assert exported_names("nnsight_collect_seconds")[0] == "ray_nnsight_collect_seconds_bucket"
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    for name, metric in METRICS.items():
        assert f"`{name}`" in page, f"docs/metrics.md does not list {name}"
        assert exported_names(name)[0] in page
        for tag in metric.tags:
            assert f"`{tag}`" in page


def test_recording_checks_tags_and_never_raises_or_needs_ray():
    from nnsight_ray._internal.observe import metrics

    with pytest.raises(ValueError, match="takes tags"):
        metrics.inc("nnsight_saved_bytes", 3, wrong="x")
    metrics.inc("nnsight_saved_bytes", 3, route="x")  # Ray not connected: a no-op

    class Broken:
        def record(self, *args):
            raise RuntimeError("exporter down")

    previous = metrics.use_backend(Broken())
    try:
        metrics.observe("nnsight_collect_seconds", 0.1, stage="merge")
    finally:
        metrics.use_backend(previous)


def test_in_flight_counts_and_tags_latency_by_outcome():
    import asyncio

    from nnsight_ray._internal.observe import metrics

    recorded = Recorder()
    previous = metrics.use_backend(recorded)
    try:
        with metrics.in_flight("chat", "plain", "r") as outcome:
            with metrics.in_flight("chat", "plain", "r"):
                pass
            outcome["status"] = metrics.http_status(404)
        for error in (RuntimeError("x"), asyncio.CancelledError()):
            with pytest.raises(type(error)):
                with metrics.in_flight("generate", "traced", "r"):
                    raise error
    finally:
        metrics.use_backend(previous)
    gauges = [v for n, v, t in recorded.calls if n == "nnsight_requests_in_flight" and t["kind"] == "plain"]
    assert gauges == [1.0, 2.0, 1.0, 0.0]
    statuses = [t["status"] for n, _, t in recorded.calls if n == "nnsight_request_latency_seconds"]
    assert statuses == ["ok", "rejected", "error", "cancelled"]
