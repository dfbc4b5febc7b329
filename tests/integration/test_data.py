"""nnsight_ray.data end to end: Ray Data's own ``build_processor`` over a Parquet file, checked against LocalVLLM.

- every save column (a layer's last token, a layer's every token, the logits)
  equals the same trace on the in-process ``local_llama``, in the model's dtype,
  next to the same greedy tokens and text;
- with ``should_continue_on_error``, a row whose intervention raises carries
  ``__inference_error__`` = ``"ValueError: <message>"``, a row vLLM refuses
  carries vLLM's, and every other row is exact; without it, the run fails with
  that row's ``"ValueError: <message>"``.

Each test runs one Ray Data pipeline on the session's Ray cluster
(``concurrency=1``): the first starts its engine in the actor (LocalVLLM); the
other two attach to the session's running deployments by name
(``engine_name``: ``tp2``, two ranks on two raylets, and ``tp1``), which stay
up after the pipeline.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import ENGINE_KWARGS, assert_close
from scrape import export_ports, scrape, total, wait_for_moves

pytestmark = pytest.mark.integration

MAX_TOKENS = 4
SAVES = [
    {"location": "model.layers.1.output", "tokens": "last"},
    {"location": "model.layers.3.output", "tokens": "all"},
    {"location": "logits", "tokens": "last"},
]
PROMPTS = ["Hello, world!", "The capital of France is", "1 2 3 4 5", "Hi", "abc def ghi jkl", "Ray and vLLM"]


def write_prompts(path, prompts) -> str:
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(len(prompts))], "text": prompts}), path)
    return str(path)


def run(config, path, keep):
    """The processor of ``config`` (through ``ray.data.llm.build_processor``) over the Parquet file: rows by id."""
    import ray
    from ray.data.llm import build_processor

    from nnsight_ray.batch.sources import local_footer_readers
    from nnsight_ray.data import NNsightEngineProcessorConfig  # noqa: F401  (registers the builder)

    processor = build_processor(
        config,
        preprocess=lambda row: {"prompt": row["text"],
                                "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0}},
        postprocess=lambda row: {name: row[name] for name in keep},
    )
    with local_footer_readers(path):  # one Parquet footer reader, not Ray's 32 actors (docs/data.md)
        ds = processor(ray.data.read_parquet(path)).materialize()  # run once: schema() and take_all() read the blocks
    return {row["id"]: row for row in ds.take_all()}, ds


def reference(local, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    """The same values from nnsight's in-process engine: residual streams (hidden + residual), logits, greedy output."""
    with local.trace(prompt, temperature=0.0, max_tokens=max_tokens) as tracer:
        one, three = local.model.layers[1].output, local.model.layers[3].output
        h1 = (one[0] + one[1])[-1].clone().save()
        h3 = (three[0] + three[1]).clone().save()
        logits = local.logits[-1].clone().save()
        result = tracer.result.save()
    return {"model.layers.1.output": h1, "model.layers.3.output": h3, "logits": logits,
            "generated_tokens": list(result.outputs[0].token_ids), "generated_text": result.outputs[0].text,
            "prompt_token_ids": list(result.prompt_token_ids)}


def test_save_columns_equal_local_traces(ray_cluster, local_llama, model_dir, tmp_path):
    from nnsight_ray.data import NNsightEngineProcessorConfig

    config = NNsightEngineProcessorConfig(model_source=model_dir, engine_kwargs=dict(ENGINE_KWARGS), concurrency=1,
                                          batch_size=4, saves=SAVES)
    columns = [save["location"] for save in SAVES]
    keep = ["id", "generated_text", "generated_tokens", "prompt_token_ids", "num_generated_tokens", *columns]
    ports = export_ports()
    before = scrape(ports)
    rows, ds = run(config, write_prompts(tmp_path / "prompts.parquet", PROMPTS), keep)

    assert sorted(rows) == [f"q{i}" for i in range(len(PROMPTS))]
    schema = ds.schema()
    for name in columns:  # tensor columns in the model's dtype (float32 here)
        described = str(schema.types[schema.names.index(name)]).lower()
        assert not any(word in described for word in ("double", "pickled", "object")), (name, described)
    for i, prompt in enumerate(PROMPTS):
        row, want = rows[f"q{i}"], reference(local_llama, prompt)
        assert list(row["prompt_token_ids"]) == want["prompt_token_ids"]
        assert list(row["generated_tokens"]) == want["generated_tokens"]
        assert row["num_generated_tokens"] == len(want["generated_tokens"]) > 0
        assert row["generated_text"] == want["generated_text"]
        tokens = len(want["prompt_token_ids"])
        for name in columns:
            got = row[name]
            assert got.dtype.name == "float32", (name, got.dtype)
            assert got.shape == tuple(want[name].shape), (name, got.shape, tuple(want[name].shape))
            assert_close(torch.from_numpy(got.copy()), want[name], rel=1e-4)
        assert row["model.layers.3.output"].shape == (tokens, 128)

    # The stage's metrics (docs/metrics.md): every row ok; each batch (4 prompts at most) with each of its phases.
    phase = lambda name: lambda s: total(s, "ray_nnsight_data_batch_seconds_count", phase=name)  # noqa: E731
    # vLLM's own series too (log_engine_metrics, on by default): the engine's prompt tokens are the rows'.
    prompt_tokens = sum(len(row["prompt_token_ids"]) for row in rows.values())
    wanted = {"ok": (lambda s: total(s, "ray_nnsight_data_rows_total", outcome="ok"), len(PROMPTS)),
              **{name: (phase(name), 2) for name in ("queued", "build", "engine", "rows", "total")},
              "vllm prompt tokens": (lambda s: total(s, "ray_vllm_prompt_tokens_total"), prompt_tokens)}
    grown = wait_for_moves(ports, before, wanted)
    assert grown["ok"] == len(PROMPTS) and grown["total"] >= 2, grown
    assert grown["vllm prompt tokens"] == prompt_tokens, grown
    assert {grown[name] for name in ("queued", "build", "engine", "rows")} == {grown["total"]}, grown
    engines = {labels["engine"] for name, labels, _ in scrape(ports) if name == "ray_nnsight_data_batches_in_flight"}
    assert any(engine.startswith("data-") for engine in engines), engines  # the actor's own engine, by its name


def test_a_failing_row_is_its_own_error_and_the_others_are_exact(ray_tp2, local_llama, model_dir, tmp_path):
    from nnsight_ray.data import NNsightEngineProcessorConfig

    intervention = tmp_path / "iv.py"
    intervention.write_text(
        "def intervene(model, tracer):\n"
        "    out = model.model.layers[2].output\n"
        "    hidden = out[0] + out[1]\n"
        "    if hidden.shape[0] == 7:\n"
        "        raise ValueError(f'seven tokens: {hidden.shape[0]}')\n"
        "    return {'h2': hidden[-1], 'top': model.logits[-1].argmax()}\n"
    )
    prompts = ["Hello, world!", "seven!!", "1 2 3 4 5", "Hi", "x" * 300]
    assert [len(local_llama.tokenizer(p)["input_ids"]) for p in prompts].count(7) == 1
    # On the session's TP=2 deployment, attached by name: its rows as exact as an engine of the actor's own.
    config = NNsightEngineProcessorConfig(model_source=model_dir, engine_name="tp2", concurrency=1,
                                          batch_size=8, should_continue_on_error=True, intervention=str(intervention))
    keep = ["id", "generated_tokens", "h2", "top"]
    ports = export_ports()
    before = scrape(ports)
    rows, _ = run(config, write_prompts(tmp_path / "prompts.parquet", prompts), keep)

    assert sorted(rows) == [f"q{i}" for i in range(len(prompts))]
    # Error rows bypass postprocess (Ray Data LLM's rule): they carry the whole row and the error.
    assert rows["q1"]["__inference_error__"] == "ValueError: seven tokens: 7"
    assert rows["q1"]["text"] == "seven!!" and rows["q1"].get("h2") is None
    refused = rows["q4"]["__inference_error__"]  # vLLM refuses the prompt: that row's error, not the batch's
    assert "maximum context length" in refused or "300" in refused, refused
    for key in ("q0", "q2", "q3"):
        row = rows[key]
        prompt = prompts[int(key[1:])]
        assert row["__inference_error__"] == ""
        with local_llama.trace(prompt, temperature=0.0, max_tokens=MAX_TOKENS) as tracer:
            out = local_llama.model.layers[2].output
            h2 = (out[0] + out[1])[-1].clone().save()
            top = local_llama.logits[-1].argmax().save()
            result = tracer.result.save()
        assert row["h2"].dtype.name == "float32"
        assert_close(torch.from_numpy(row["h2"].copy()), h2)  # TP=2: two partial sums
        assert int(row["top"]) == int(top)
        assert list(row["generated_tokens"]) == list(result.outputs[0].token_ids)
    # The stage's metrics on Ray's export ports (docs/metrics.md): the rows by outcome and error type; the one
    # batch (it failed as a whole, then ran row by row) once.
    rows_of = lambda **tags: lambda s: total(s, "ray_nnsight_data_rows_total", engine="tp2", **tags)  # noqa: E731
    wanted = {"ok": (rows_of(outcome="ok"), 3), "intervention": (rows_of(outcome="failed", type="ValueError"), 1),
              "failed": (rows_of(outcome="failed"), 2),
              "batches": (lambda s: total(s, "ray_nnsight_data_batch_seconds_count", engine="tp2", phase="total"), 1)}
    grown = wait_for_moves(ports, before, wanted)
    assert grown == {"ok": 3, "intervention": 1, "failed": 2, "batches": 1}, grown
    with ray_tp2.trace("still serving", temperature=0.0, max_tokens=1):  # the pipeline left the engine running
        logits = ray_tp2.logits.save()
    assert logits.shape[-1] == local_llama.tokenizer.vocab_size or logits.numel() > 0


def test_without_continue_on_error_the_run_fails_with_the_rows_message(ray_tp1, model_dir, tmp_path):
    from nnsight_ray.data import NNsightEngineProcessorConfig

    intervention = tmp_path / "iv.py"
    intervention.write_text(
        "def intervene(model, tracer):\n"
        "    hidden = model.model.layers[2].output[0]\n"
        "    if hidden.shape[0] == 7:\n"
        "        raise ValueError(f'seven tokens: {hidden.shape[0]}')\n"
        "    return {'h2': hidden[-1]}\n"
    )
    config = NNsightEngineProcessorConfig(model_source=model_dir, engine_name="tp1", concurrency=1,
                                          batch_size=8, intervention=str(intervention))
    with pytest.raises(Exception) as error:
        run(config, write_prompts(tmp_path / "prompts.parquet", ["Hello, world!", "seven!!", "Hi"]), ["id", "h2"])
    assert "RequestError" in str(error.value) and "ValueError: seven tokens: 7" in str(error.value)
