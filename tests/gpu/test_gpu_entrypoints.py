"""The two other ways in, on the GPU: a Serve app over HTTP, and a batch run through ``ray job submit``."""

from __future__ import annotations

import json
import time

import pytest
import torch

from .conftest import ENGINE_KWARGS, KEY, assert_close
from ray_head import free_ports, submit_batch

PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "abc"]


@pytest.fixture(scope="module")
def served(head, gpu_model_dir):
    import httpx
    from ray import serve

    from nnsight_ray.serve import build_app

    (port,) = free_ports(1)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": gpu_model_dir, "engine_kwargs": ENGINE_KWARGS, "num_replicas": 1,
                         "api_key": KEY}), name="gpu-app", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "Serve app not healthy after 600 s"
        time.sleep(2)
    try:
        yield url
    finally:
        serve.delete("gpu-app")
        serve.shutdown()


def test_batch_through_ray_job_submit(head, gpu_model_dir, hf, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    config = {
        "model": {"path": gpu_model_dir},
        "engine": {"engine_kwargs": dict(ENGINE_KWARGS), "replicas": 1, "placement_strategy": "PACK"},
        "prompts": {"path": str(prompts)},
        "saves": [{"location": "logits"}, {"location": "model.layers.1.output", "tokens": "all"},
                  {"location": "model.layers.3.output"}],
        "output": {"dir": str(tmp_path / "out"), "shard_size": 2},
        "runner": {"max_in_flight": 4, "prompts_per_trace": 2, "progress_interval_s": 1},
    }
    done = submit_batch(head["dashboard"], config, tmp_path, head["env"])
    assert "SUCCEEDED" in done.stdout and "on Ray Data" in done.stdout
    import pyarrow.parquet as pq

    # the CLI runs a Ray Data pipeline: its rows are under out/data, in no set order
    rows = sorted((r for p in sorted((tmp_path / "out" / "data").glob("*.parquet"))
                   for r in pq.read_table(p).to_pylist()), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(len(PROMPTS))]
    for row in rows:
        assert row["error"] is None
        want = hf.run(row["prompt"])

        def value(name):
            return torch.tensor(row[name], dtype=torch.float32).reshape(row[name + ".shape"])

        assert_close(value("logits"), want["logits"], what=f"batch logits {row['id']}")
        assert_close(value("model.layers.1.output"), want["layers"][1], what=f"batch layer 1 {row['id']}")
        assert_close(value("model.layers.3.output"), want["layers"][3][-1], what=f"batch layer 3 {row['id']}")


# Last: the Serve replica holds the GPU until the module ends.
def test_serve_over_http_with_nnsights_client(served, gpu_model_dir, hf):
    from nnsight_ray import LocalVLLM

    client = LocalVLLM(gpu_model_dir)  # meta only: nnsight's client side
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, serve=served, api_key=KEY):
        out = client.model.layers[2].output.save()
        logits = client.logits.save()
    want = hf.run(PROMPTS[1])
    assert_close(out[0] + out[1], want["layers"][2], what="serve layer 2")
    assert_close(logits[-1], want["logits"], what="serve logits")
