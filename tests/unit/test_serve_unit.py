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
                                     "placement_strategy": "PACK", "max_model_len": 256}


@pytest.mark.parametrize("bad,needle", [
    ({}, "model"),
    ({"model": "/m", "tp": 2}, "tp"),
    ({"model": "/m", "tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"model": "/m", "placement_strategy": "PACKED"}, "placement_strategy"),
    ({"model": "/m", "max_body_bytes": 0}, "max_body_bytes"),
    ({"model": "/m", "engine_kwargs": "{not json"}, "not JSON"),
    ({"model": "/m", "engine_kwargs": {"tensor_parallel_size": 2}}, "build_app arguments instead"),
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


def test_build_app_binds_the_replica_and_its_registry(monkeypatch):
    monkeypatch.setenv("NNSIGHT_RAY_API_KEY", "from-env")
    app = build_app({"model": "/m", "num_replicas": 2})
    deployment = app._bound_deployment
    assert deployment.name == "NNsightDeployment" and deployment.num_replicas == 2
    args, registry = deployment.init_args
    assert args.resolved_api_key({}) == "from-env"
    assert registry._bound_deployment.name == "NNsightRegistry"
    with pytest.raises(ServeArgsError):
        build_app({"model": "/m", "nope": 1})


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
    for bad in ({"prompt": "a", "stream": True}, {"prompt": "a", "echo": True}, {"prompt": "a", "best_of": 2},
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


def replica(state="ready", api_key=None, engine=None, registry=None):
    """An ``NNsightDeployment`` instance built by hand (no Serve, no engine) and a client for its app."""
    from starlette.testclient import TestClient

    from nnsight_ray.serve.deployment import NNsightDeployment

    cls = NNsightDeployment.func_or_class
    obj = cls.__new__(cls)
    obj.args = ServeArgs.parse({"model": "/m", "max_body_bytes": 4096})
    obj.api_key, obj.engine_name, obj.state, obj.error = api_key, "app-replica", state, None
    if state == "failed":
        obj.error = "PlacementError: no room"
    obj.model = SimpleNamespace(interleaver=SimpleNamespace(cancel=lambda: None))
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
    assert replica().get("/health").json() == {"status": "ok", "engine": "app-replica"}


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

    client = replica(engine=SimpleNamespace(generate_async=generate_async))
    ok = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3, "temperature": 0,
                                              "nnsight": {"edits": ["probe"]}},
                     headers={"nnsight-return-saves": "true"})
    assert ok.status_code == 200 and [c["text"] for c in ok.json()["choices"]] == ["xyz", "xyz"]
    assert decode_saves(ok.json()["nnsight_saves"]) == [{"h": 1}, {"h": 1}]
    prompts, params = seen[0]
    assert prompts == ["a", "b"] and isinstance(params, SamplingParams)
    assert (params.max_tokens, params.temperature, params.extra_args) == (3, 0.0, {"nnsight_edits": ["probe"]})
    bad = client.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert bad.status_code == 400 and "stream" in bad.json()["error"]["message"]
    assert client.post("/v1/completions", content=b"{not json").status_code == 400

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
