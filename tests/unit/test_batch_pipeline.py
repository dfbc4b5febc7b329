"""The batch CLI's Ray Data path without a cluster: its processor config, the prompt source, the row format,
the exactly-once count (``nnsight_ray.batch.pipeline``). End to end: tests/integration/test_batch_data.py."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnsight_ray.batch.config import PromptsConfig, validate
from nnsight_ray.batch.pipeline import (_ACTIVATION_ROW, _activation_encoder, _caster, _failed_values, _row_encoder,
                                        _row_normalizer, check_output, committed_rows, remove_orphans)
from nnsight_ray.batch.sources import local_footer_readers


def config(tmp_path, **sections):
    data = {"model": {"path": "m"}, "prompts": {"path": str(tmp_path / "p.jsonl")},
            "saves": [{"location": "model.layers.1.output", "tokens": "all"}], "output": {"dir": str(tmp_path / "o")}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return validate(data)


def test_connect_runs_on_the_named_engines_with_a_batch_in_flight_on_each(tmp_path):
    """--connect: the processor attaches to the deployments (no engine section, no group), one client actor
    unless asked for more (the batches in flight split among them)."""
    from types import SimpleNamespace

    from nnsight_ray.batch.pipeline import processor_config

    for output in ({}, {"format": "activations", "shard_size": 4}):
        made = processor_config(SimpleNamespace(model_path="/m", config=config(
            tmp_path, engine={"tensor_parallel_size": 2, "replicas": 3}, output=output)), ["a", "b", "c"])
        assert made.engine_names == ["a", "b", "c"] and made.engine_kwargs == {} and not made.rank_actors
        assert made.concurrency == (1, 1) and made.max_concurrent_batches >= 3 and made.placement_group_config is None
        assert (made.activations is not None) == bool(output) and made.model_source == "/m"
    made = processor_config(SimpleNamespace(model_path="/m", config=config(tmp_path)), ["a"], clients=2)
    assert made.concurrency == (2, 2) and made.max_concurrent_batches == 4  # 256 in flight / 32 a batch / 2


def test_prompt_sources_local_or_any_uri_with_a_format():
    assert PromptsConfig(path="p.jsonl").kind == "jsonl" and not PromptsConfig(path="p.jsonl").remote
    uri = PromptsConfig(path="s3://bucket/prompts/", format="parquet")
    assert uri.kind == "parquet" and uri.remote
    assert PromptsConfig(path="hf://datasets/org/name/train.parquet").remote
    assert not PromptsConfig(path="file:///data/p.txt").remote
    with pytest.raises(ValueError, match="set prompts.format"):
        PromptsConfig(path="s3://bucket/prompts/")




def rows_as_written(rows, names):
    """Rows through the pipeline's last three steps (postprocess on successes, normalize, cast) to one table."""
    encode, normalize = _row_encoder("id", "text", names), _row_normalizer("id", "text", _failed_values(names))
    out = [normalize(row if row.get("__inference_error__") else {**encode(row), "__inference_error__": ""})
           for row in rows]
    columns = {key: [row.get(key) for row in out] for key in dict.fromkeys(k for row in out for k in row)}
    return _caster("id")(pa.table(columns))


def test_local_parquet_reads_use_one_footer_reader_unless_the_user_chose(monkeypatch, tmp_path):
    """Ray Data starts 32 footer-reader actors per Parquet read unless told; local reads need one."""
    import os

    monkeypatch.delenv("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", raising=False)
    with local_footer_readers(tmp_path / "p.parquet", str(tmp_path / "checkpoint")):
        assert os.environ["RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"] == "1"
    assert "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS" not in os.environ
    with local_footer_readers("s3://bucket/prompts/", tmp_path / "checkpoint"):  # object storage: Ray's pool
        assert "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS" not in os.environ
    monkeypatch.setenv("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "8")
    with local_footer_readers(tmp_path / "p.parquet"):
        assert os.environ["RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"] == "8"
    assert os.environ["RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"] == "8"


def test_rows_have_one_schema_successes_and_failures_alike():
    h = np.arange(6, dtype=np.float16).reshape(2, 3)
    ok = {"id": "a", "text": "hi", "prompt": "hi", "generated_text": " there", "generated_tokens": [1],
          "model.layers.1.output": h, "params": "{}", "__inference_error__": ""}
    failed = {"id": "b", "text": "x" * 9, "prompt": "x" * 9, "sampling_params": {"max_tokens": 1},
              "generated_text": "", "model.layers.1.output": None,
              "__inference_error__": "VLLMValidationError: too long"}
    table = rows_as_written([ok, failed], ["model.layers.1.output"])
    assert table.schema.field("model.layers.1.output").type == pa.list_(pa.float32())
    assert table.schema.field("model.layers.1.output.shape").type == pa.list_(pa.int32())
    assert table.column_names == ["id", "prompt", "error", "generated_text", "model.layers.1.output",
                                  "model.layers.1.output.shape"]
    first, second = table.to_pylist()
    assert first["error"] is None and first["model.layers.1.output"] == [0, 1, 2, 3, 4, 5]
    assert first["model.layers.1.output.shape"] == [2, 3] and first["generated_text"] == " there"
    assert second == {"id": "b", "prompt": "x" * 9, "error": "VLLMValidationError: too long", "generated_text": None,
                      "model.layers.1.output": None, "model.layers.1.output.shape": None}


def test_an_interventions_values_are_the_names_it_returned():
    ok = {"id": 3, "text": "hi", "prompt": "hi", "generated_text": "!", "top": np.int64(7),
          "h2": np.ones(4, np.float32), "num_input_tokens": 2, "__inference_error__": ""}
    table = rows_as_written([ok], None)
    assert table.column_names == ["id", "prompt", "error", "generated_text", "top", "top.shape", "h2", "h2.shape"]
    assert table.to_pylist()[0]["top"] == [7.0] and table.to_pylist()[0]["top.shape"] == []


def test_the_output_is_counted_from_the_files(tmp_path):
    """What a run reports: distinct ids in data/, ids written twice, the failed rows as errors.jsonl lines."""
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"id": ["a", "b"], "error": [None, "ValueError: no"]}), tmp_path / "data" / "x_0.parquet")
    pq.write_table(pa.table({"id": ["c"], "error": [None]}), tmp_path / "data" / "x_1.parquet")
    assert check_output(tmp_path, "id") == (3, 0, [{"id": "b", "type": "ValueError", "message": "no",
                                                    "file": "x_0.parquet"}])
    pq.write_table(pa.table({"id": ["a"], "error": [None]}), tmp_path / "data" / "x_2.parquet")
    assert check_output(tmp_path, "id")[:2] == (3, 1)

    (tmp_path / "checkpoint").mkdir()
    pq.write_table(pa.table({"id": ["a", "b"]}), tmp_path / "checkpoint" / "x_0.parquet")
    pq.write_table(pa.table({"id": ["c"]}), tmp_path / "checkpoint" / "x_1.pending.parquet")
    assert committed_rows(tmp_path / "checkpoint") == 2, "a pending checkpoint is not done"


def test_the_engine_layout_becomes_the_processors(tmp_path):
    """The layout in engine_kwargs, a placement group per engine actor with a bundle per rank (at TP=1 too, with
    several batches in flight: rank actors); one batch in flight at TP=1: the engine in the actor."""
    from types import SimpleNamespace

    from nnsight_ray.batch.pipeline import processor_config

    one = processor_config(SimpleNamespace(config=config(tmp_path, engine={"replicas": 2}), model_path="/m"))
    assert one.rank_actors and one.rank_bundles() == ([{"CPU": 1.0}], "PACK")
    assert "tensor_parallel_size" not in one.engine_kwargs and one.max_concurrent_batches == 8
    assert one.concurrency == (2, 2) and one.batch_size == 32 and one.model_source == "/m"
    serial = processor_config(SimpleNamespace(model_path="/m", config=config(tmp_path, runner={"max_in_flight": 32})))
    assert serial.max_concurrent_batches == 1 and not serial.rank_actors and serial.placement_group_config is None
    four = processor_config(SimpleNamespace(model_path="/m", config=config(
        tmp_path, engine={"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "placement_strategy": "SPREAD"})))
    assert four.engine_kwargs["tensor_parallel_size"] == 2 and four.engine_kwargs["pipeline_parallel_size"] == 2
    bundles, strategy = four.rank_bundles()
    assert bundles == [{"CPU": 1.0}] * 4 and strategy == "SPREAD"


def test_an_activation_runs_rows_say_where_each_prompts_token_rows_are():
    encode, normalize = _activation_encoder("id", "text", "activations"), _row_normalizer("id", "text", _ACTIVATION_ROW)
    ok = {"id": 4, "text": "hi", "prompt": "hi", "activation_files": ["part-1.stage0.safetensors",
                                                                      "part-1.stage1.safetensors"],
          "activation_index": np.int64(3), "activation_rows": 7, "generated_text": "", "__inference_error__": ""}
    failed = {"id": 5, "text": "x" * 9, "prompt": "x" * 9, "activation_files": None, "activation_index": None,
              "activation_rows": None, "__inference_error__": "VLLMValidationError: too long"}
    out = [normalize({**encode(ok), "__inference_error__": ""}), normalize(failed)]
    table = _caster("id", activations=True)(pa.table({key: [row[key] for row in out] for key in out[0]}))
    assert table.column_names == ["id", "prompt", "error", "files", "prompt_index", "tokens"]
    assert table.schema.field("files").type == pa.list_(pa.string())
    assert table.schema.field("prompt_index").type == table.schema.field("tokens").type == pa.int64()
    assert table.to_pylist() == [
        {"id": 4, "prompt": "hi", "error": None, "prompt_index": 3, "tokens": 7,
         "files": ["activations/part-1.stage0.safetensors", "activations/part-1.stage1.safetensors"]},
        {"id": 5, "prompt": "x" * 9, "error": "VLLMValidationError: too long", "files": None, "prompt_index": None,
         "tokens": None}]


def test_files_no_row_names_are_removed_and_missing_ones_reported(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "activations").mkdir()
    pq.write_table(pa.table({"id": ["a", "b", "c"], "error": [None, None, "ValueError: no"],
                             "files": [["activations/p1.safetensors"], ["activations/p1.safetensors"], None]}),
                   tmp_path / "data" / "x_0.parquet")
    pq.write_table(pa.table({"id": ["d"], "error": [None], "files": [["activations/p2.safetensors"]]}),
                   tmp_path / "data" / "x_1.parquet")
    for name in ("p1.safetensors", "p2.safetensors", "p0.safetensors", "p3.safetensors.tmp-17", "notes.txt"):
        (tmp_path / "activations" / name).write_bytes(b"x")
    named, removed, missing = remove_orphans(tmp_path)
    assert named == {"activations/p1.safetensors", "activations/p2.safetensors"} and missing == []
    assert removed == ["activations/p0.safetensors", "activations/p3.safetensors.tmp-17"]
    assert sorted(p.name for p in (tmp_path / "activations").iterdir()) == ["notes.txt", "p1.safetensors",
                                                                           "p2.safetensors"]
    (tmp_path / "activations" / "p2.safetensors").unlink()
    assert remove_orphans(tmp_path)[1:] == ([], ["activations/p2.safetensors"])


def test_orphans_are_removed_only_after_a_complete_run(tmp_path):
    from nnsight_ray.batch.pipeline import BatchResult, _settle_files

    (tmp_path / "data").mkdir()
    (tmp_path / "activations").mkdir()
    pq.write_table(pa.table({"id": ["a"], "error": [None], "files": [["activations/p1.safetensors"]]}),
                   tmp_path / "data" / "x_0.parquet")
    for name in ("p1.safetensors", "p0.safetensors"):
        (tmp_path / "activations" / name).write_bytes(b"x")
    unfinished = BatchResult(tmp_path, 2, 0, 1, 0, 0, 1.0)
    _settle_files(unfinished)  # p0 may be a part whose rows are not written yet
    assert (tmp_path / "activations" / "p0.safetensors").exists() and unfinished.activation_files is None
    done = BatchResult(tmp_path, 1, 0, 1, 0, 0, 1.0)
    _settle_files(done)
    assert done.complete and (done.activation_files, done.orphans_removed) == (1, 1)
    assert not (tmp_path / "activations" / "p0.safetensors").exists() and "1 files, 1 left by" in done.summary()
    (tmp_path / "activations" / "p1.safetensors").unlink()
    lost = BatchResult(tmp_path, 1, 0, 1, 0, 0, 1.0)
    _settle_files(lost)
    assert not lost.complete and "the rows name are missing" in lost.failure


def test_an_activation_dataset_is_the_processors_activation_mode(tmp_path):
    """A batch a block of output.shard_size prompts (one part), rank actors at TP=1, files into output.dir."""
    from types import SimpleNamespace

    from nnsight_ray.batch.pipeline import processor_config

    made = processor_config(SimpleNamespace(model_path="/m", config=config(
        tmp_path, output={"format": "activations", "shard_size": 4, "dtype": "float16", "fsync": True})))
    assert made.saves is None and made.rank_actors and made.world_size == 1
    assert made.activations.dir == str(tmp_path / "o" / "activations") and made.activations.dtype == "float16"
    assert made.activations.locations == ["model.layers.1.output"] and made.activations.fsync
    assert made.batch_size == 4 and made.max_concurrent_batches == 8  # 8 x shard_size in flight
    assert made.rank_bundles() == ([{"CPU": 1.0}], "PACK")


def test_a_folder_the_runner_wrote_is_refused_not_run_again(tmp_path):
    """Runs keep rows under data/; over an earlier version's runner shards one would run every prompt again."""
    from nnsight_ray.batch.errors import BatchConfigError
    from nnsight_ray.batch.pipeline import RUNNER_FORMAT as FORMAT
    from nnsight_ray.batch.pipeline import refuse_runner_folder
    from nnsight_ray.batch.preflight import prepare

    made = config(tmp_path)
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    first = prepare(made, resolve=False)
    refuse_runner_folder(first)  # a new folder
    first.run_dir.prepare()
    first.run_dir.manifest_path.write_text(json.dumps({"format": FORMAT, "status": "incomplete",
                                                       "fingerprint": first.run_dir.fingerprint}))
    with pytest.raises(BatchConfigError, match="holds shards of an earlier nnsight_ray's hand-written runner \\(incomplete"):
        refuse_runner_folder(prepare(made, resolve=False))
    first.run_dir.manifest_path.write_text(json.dumps({"format": "nnsight_ray.batch/2 (ray data)",
                                                       "fingerprint": first.run_dir.fingerprint}))
    refuse_runner_folder(prepare(made, resolve=False))  # its own folder resumes


def test_the_summary_says_whether_the_rate_includes_an_engine_start(tmp_path):
    from nnsight_ray.batch.pipeline import BatchResult

    assert "(engine start included)" in BatchResult(tmp_path, 4, 0, 4, 0, 0, 2.0).summary()
    on_running = BatchResult(tmp_path, 4, 0, 4, 0, 0, 2.0, connected=True).summary()
    assert "(on running engines)" in on_running and "engine start" not in on_running
    assert "2.0 prompts/s" in on_running
