"""``python -m nnsight_ray.batch`` on Ray Data (``nnsight_ray.batch.pipeline``): a real driver process, real Ray
Data, the real vLLM CPU engine on the session's Ray cluster, values against nnsight's in-process engine.

- prompts read by ``ray.data`` (a Parquet file, a ``.txt`` file through ``TextLines``, a ``.jsonl`` file);
- the run's rows equal ``local_llama``'s traces; a prompt vLLM refuses is a row with ``error`` and a line in
  ``errors.jsonl``, and the run goes on;
- the driver SIGKILLed after some files were committed, then the same command again: it resumes through Ray
  Data's checkpointing by prompt id, the files committed before the kill are kept as they were, and every
  prompt is in the output exactly once (counted here from the files, not from the run's own report);
- a third run of the finished folder starts no engine and writes nothing.

The kill and the ``.txt`` runs attach to the session's deployments (``--connect tp1`` / ``tp2``). The command's
own engines are run by ``test_batch.py`` (the documented command, ``ray job submit``); at TP=2 x PP=2 the same
processor runs in ``test_data_parallel.py``, and the CLI's layout -> processor config is a unit test
(``test_batch_pipeline.py``). Every subprocess is bounded (``timeout``), and so is the wait for the kill point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ENGINE_KWARGS, assert_close, committed_checkpoints as committed, kill_after_commits

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SAVES = [{"location": "logits"}, {"location": "model.layers.1.output", "tokens": "all"},
         {"location": "model.layers.3.output"}]


def reference(local, prompt: str) -> dict:
    with local.trace(prompt, temperature=0.0, max_tokens=1):
        one, three = local.model.layers[1].output, local.model.layers[3].output
        h1 = (one[0] + one[1]).clone().save()
        h3 = (three[0] + three[1])[-1].clone().save()
        logits = local.logits[-1].clone().save()
    return {"model.layers.1.output": h1, "model.layers.3.output": h3, "logits": logits}


def value(row: dict, name: str):
    import torch

    return torch.tensor(row[name], dtype=torch.float32).reshape(row[name + ".shape"])


def written(folder: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [row for path in sorted((folder / "data").glob("*.parquet")) for row in pq.read_table(path).to_pylist()]


def cli(config: dict, tmp_path: Path, address: str) -> tuple[list[str], dict]:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return [sys.executable, "-m", "nnsight_ray.batch", "--config", str(path), "--address", address], env


def reads(op) -> bool:
    """The plan starts with an operator Ray Data's checkpointing filters (its planner's own list)."""
    from ray.data._internal.planner.planner import Planner

    return isinstance(op, Planner._CHECKPOINT_FILTER_OPS) or any(reads(child) for child in op.input_dependencies)


def test_read_prompts_through_ray_data(ray_cluster, tmp_path):
    """Each local format as a Ray Data ``Read`` (what checkpointing filters), ids as the source holds them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nnsight_ray.batch.config import PromptsConfig
    from nnsight_ray.batch.errors import BatchConfigError
    from nnsight_ray.batch.sources import check_source, local_footer_readers, read_dataset

    (tmp_path / "p.txt").write_text("first\n\n third\n")
    (tmp_path / "p.jsonl").write_text('{"key": "a", "text": "x", "other": 1}\n{"key": "b", "text": "y", "other": 2}\n')
    pq.write_table(pa.table({"uid": [10, 11], "prompt": ["p", "q"]}), tmp_path / "p.parquet")
    cases = [(PromptsConfig(path=str(tmp_path / "p.txt")),
              [{"id": "1", "prompt": "first"}, {"id": "3", "prompt": " third"}]),
             (PromptsConfig(path=str(tmp_path / "p.jsonl"), id_field="key", text_field="text"),
              [{"key": "a", "text": "x"}, {"key": "b", "text": "y"}]),
             (PromptsConfig(path=str(tmp_path / "p.parquet"), id_field="uid"),
              [{"uid": 10, "prompt": "p"}, {"uid": 11, "prompt": "q"}])]
    for source, want in cases:
        with local_footer_readers(source.path):  # planned at read_dataset, run at take_all
            dataset = read_dataset(source)
            assert sorted(dataset.take_all(), key=str) == sorted(want, key=str)
        assert reads(dataset._logical_plan.dag), "a Read at the root: Ray Data's checkpointing filters it"
        assert check_source(source) == 2
    with pytest.raises(BatchConfigError, match=r"no column 'id'"):
        check_source(PromptsConfig(path=str(tmp_path / "p.parquet")))


def remote_reader(env: dict):
    """A task that checks and reads a prompt source on a worker whose runtime env is ``env`` (a job's ``--env``).

    It returns the count and the rows, or the check's message. One Parquet footer
    reader, not Ray Data's 32 actors per read (docs/ci.md): 2 CPUs here.
    """
    import ray

    from nnsight_ray.batch.errors import BatchConfigError
    from nnsight_ray.batch.sources import FOOTER_READERS, check_source, read_dataset

    @ray.remote(num_cpus=0, runtime_env={"env_vars": {**env, FOOTER_READERS: "1"}})
    def read(source):
        try:
            count = check_source(source)
        except BatchConfigError as error:
            return str(error)
        return count, sorted(read_dataset(source).take_all(), key=str)

    return read


def test_read_prompts_from_object_storage_through_ray_data(ray_cluster):
    """s3:// prompts (an S3 server on loopback) read on Ray's workers, reached through the job's env variables.

    The reads run in a task whose runtime env carries ``AWS_ENDPOINT_URL`` and the
    credentials, as a job submitted with ``nnsight-ray submit --env`` does: Ray
    Data's read tasks inherit it. A Parquet folder (the usual form), a JSONL
    object and a text object; a missing object fails the check, naming it.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from object_store import s3_server

    from nnsight_ray.batch.config import PromptsConfig

    with s3_server() as (env, s3):
        for part, ids in enumerate(([1, 2], [3])):
            pq.write_table(pa.table({"uid": ids, "prompt": [f"p{i}" for i in ids]}),
                           f"prompts/folder/part-{part}.parquet", filesystem=s3)
        with s3.open_output_stream("prompts/p.jsonl") as out:
            out.write(b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
        with s3.open_output_stream("prompts/p.txt") as out:
            out.write(b"first\n\nthird\n")

        read = remote_reader(env)
        cases = [(PromptsConfig(path="s3://prompts/folder/", format="parquet", id_field="uid"),
                  (3, [{"uid": i, "prompt": f"p{i}"} for i in (1, 2, 3)])),
                 (PromptsConfig(path="s3://prompts/p.jsonl"), (2, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])),
                 (PromptsConfig(path="s3://prompts/p.txt"), (2, [{"id": "1", "prompt": "first"},
                                                                 {"id": "3", "prompt": "third"}]))]
        for source, want in cases:
            assert ray.get(read.remote(source), timeout=300) == want, source.path
        missing = ray.get(read.remote(PromptsConfig(path="s3://prompts/none.parquet")), timeout=300)
        assert "prompts.path 's3://prompts/none.parquet': Ray Data cannot read it" in missing, missing


def test_read_prompts_from_a_hugging_face_dataset_through_ray_data(ray_cluster):
    """hf://datasets/... prompts (a Hub on loopback: its HTTP API) read on Ray's workers through ``HF_ENDPOINT``."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from object_store import hub_server

    from nnsight_ray.batch.config import PromptsConfig

    files = {}
    for part, ids in enumerate((["a", "b"], ["c"])):
        buffer = io.BytesIO()
        pq.write_table(pa.table({"id": ids, "text": [f"t{i}" for i in ids]}), buffer)
        files[f"data/train-{part}.parquet"] = buffer.getvalue()
    files["extra/p.jsonl"] = b'{"id": "j", "prompt": "jsonl"}\n'
    with hub_server(files, repo="org/prompts") as env:
        read = remote_reader(env)
        cases = [(PromptsConfig(path="hf://datasets/org/prompts/data/", format="parquet", text_field="text"),
                  (3, [{"id": i, "text": f"t{i}"} for i in "abc"])),
                 (PromptsConfig(path="hf://datasets/org/prompts/extra/p.jsonl"), (1, [{"id": "j", "prompt": "jsonl"}]))]
        for source, want in cases:
            assert ray.get(read.remote(source), timeout=300) == want, source.path
        missing = ray.get(read.remote(PromptsConfig(path="hf://datasets/org/prompts/none.parquet")), timeout=300)
        assert "Ray Data cannot read it" in missing, missing


def test_a_killed_driver_resumes_through_ray_data_checkpointing_with_every_prompt_once(ray_cluster, ray_tp1,
                                                                                      local_llama, model_dir,
                                                                                      tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [f"resume {i} " + "xyz"[: i % 3] for i in range(60)]
    prompts[17] = "x" * 300  # longer than max_model_len: vLLM refuses it, its row carries the error
    ids = [f"q{i}" for i in range(len(prompts))]
    source = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": ids, "text": prompts}), source)
    out = tmp_path / "out"
    config = {"model": {"path": model_dir}, "engine": {"engine_kwargs": dict(ENGINE_KWARGS)},
              "prompts": {"path": str(source), "text_field": "text"}, "saves": SAVES,
              "sampling": {"max_tokens": 16},  # slow enough to kill between files
              "output": {"dir": str(out), "shard_size": 4},
              "runner": {"max_in_flight": 2, "prompts_per_trace": 2, "progress_interval_s": 1}}
    command, env = cli(config, tmp_path, ray_cluster.address)
    command += ["--connect", "tp1"]  # the session's engine: the driver's kill leaves it serving

    # bounded: the pool's start on a loaded 2-core machine took minutes
    done_before = kill_after_commits(command, env, tmp_path / "first.log", out, seconds=600)
    assert 8 <= done_before < len(prompts), f"kill the run midway: {done_before} prompts committed"
    kept = {}
    for path in committed(out):  # the data files of committed checkpoints: a rerun must not touch them
        for data in (out / "data").glob(path.stem + "*.parquet"):
            kept[data.name] = (data.stat().st_ino, data.stat().st_mtime_ns)
    assert kept

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"{done_before} already done" in second.stdout and "each once" in second.stdout

    for name, stamp in kept.items():
        path = out / "data" / name
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == stamp, f"{name} was rewritten"
    rows = written(out)
    assert sorted(r["id"] for r in rows) == sorted(ids), "every prompt exactly once"
    assert not list((out / "checkpoint").glob("*.pending.parquet"))
    by_id = {r["id"]: r for r in rows}
    assert by_id["q17"]["error"].startswith("VLLMValidationError") and by_id["q17"]["logits"] is None
    assert [r["id"] for r in rows if r["error"]] == ["q17"]
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["type"]) for e in errors] == [("q17", "VLLMValidationError")]
    assert "maximum context length" in errors[0]["message"]
    for key in ("q0", "q5", "q31", "q59"):
        row = by_id[key]
        want = reference(local_llama, row["prompt"])
        for name in ("logits", "model.layers.1.output", "model.layers.3.output"):
            assert_close(value(row, name), want[name])
    assert value(by_id["q0"], "model.layers.1.output").shape[1] == 128 and len(by_id["q0"]["generated_text"]) > 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["prompts_done"] == len(prompts)
    assert [r["status"] for r in manifest["runs"]] == ["running", "complete"]

    files = sorted(p.name for p in (out / "data").iterdir())
    third = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert f"0 prompts run, {len(prompts)} already done" in third.stdout
    assert "NNsightEngineStageUDF" not in third.stdout + third.stderr, "a finished folder starts no actor"
    assert sorted(p.name for p in (out / "data").iterdir()) == files


def test_an_intervention_over_a_txt_file_fails_its_prompt_alone(ray_cluster, ray_tp2, local_llama, model_dir,
                                                                 tmp_path):
    """``intervention`` instead of saves, prompts from a ``.txt`` file (ids = line numbers), a key from ``--set``,
    on the session's TP=2 deployment (``--connect tp2``): the prompt whose ``intervene`` raises is a row with
    ``"ValueError: ..."`` and a line in errors.jsonl, every other row equals the in-process engine's."""
    prompts = ["Hello, world!", "seven!!", "1 2 3 4 5", "Hi", "abc def ghi jkl"]
    assert [len(local_llama.tokenizer(p)["input_ids"]) for p in prompts].count(7) == 1
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    (tmp_path / "iv.py").write_text(
        "def intervene(model, tracer):\n"
        "    out = model.model.layers[2].output\n"
        "    hidden = out[0] + out[1]\n"
        "    if hidden.shape[0] == 7:\n"
        "        raise ValueError(f'seven tokens: {hidden.shape[0]}')\n"
        "    return {'h2': hidden[-1], 'top': model.logits[-1].argmax()}\n")
    out = tmp_path / "out"
    config = {"model": {"path": model_dir}, "engine": {"engine_kwargs": dict(ENGINE_KWARGS)},
              "prompts": {"path": str(tmp_path / "prompts.txt")}, "intervention": str(tmp_path / "iv.py"),
              "output": {"dir": str(out), "shard_size": 2}, "runner": {"max_in_flight": 8, "prompts_per_trace": 4}}
    command, env = cli(config, tmp_path, ray_cluster.address)
    done = subprocess.run(command + ["--set", "output.shard_size=3", "--connect", "tp2"], env=env,
                          capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "5 prompts run, 0 already done, 1 errors" in done.stdout and "on Ray Data" in done.stdout
    runs = json.loads((out / "manifest.json").read_text())["runs"]
    assert runs[-1]["connected"] == ["tp2"]
    by_id = {r["id"]: r for r in written(out)}
    assert sorted(by_id) == ["1", "2", "3", "4", "5"]
    assert by_id["2"]["error"] == "ValueError: seven tokens: 7" and by_id["2"]["prompt"] == "seven!!"
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["type"], e["message"]) for e in errors] == [("2", "ValueError", "seven tokens: 7")]
    assert json.loads((out / "manifest.json").read_text())["config"]["output"]["shard_size"] == 3  # from --set
    for key in ("1", "3", "4", "5"):
        row = by_id[key]
        with local_llama.trace(row["prompt"], temperature=0.0, max_tokens=1):
            o = local_llama.model.layers[2].output
            h2 = (o[0] + o[1])[-1].clone().save()
            top = local_llama.logits[-1].argmax().save()
        assert row["error"] is None and row["h2.shape"] == [128] and row["top"] == [float(top)]
        assert_close(value(row, "h2"), h2)


def fake_processor(fail_on: str | None = None):
    """``build_processor`` with the engine stage replaced by a row function (a value per prompt from its id), so
    Ray Data's reading, checkpointing and writing run for real, in seconds; ``fail_on``: that prompt's task raises,
    as a batch does whose engine kept dying."""
    import numpy as np

    def build(config, preprocess=None, postprocess=None, builder_kwargs=None):
        def stage(row):
            if row["id"] == fail_on:
                raise RuntimeError("engine died")
            return postprocess({**row, "generated_text": "!", "logits": np.full(3, float(row["id"][1:]))})

        return lambda dataset: dataset.map(stage)

    return build


def test_ray_data_checkpointing_redoes_pending_files_and_a_failed_run_resumes(ray_cluster, tmp_path, monkeypatch):
    """What a killed driver can leave (a file whose checkpoint is still pending, a file never written) and a run
    that failed (exit 1): the next run writes each missing prompt once, keeps every committed file."""
    from nnsight_ray.batch import pipeline
    from nnsight_ray.batch.config import validate
    from nnsight_ray.batch.preflight import prepare

    ids = [f"q{i}" for i in range(20)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "prompt": f"prompt {i}"}) + "\n" for i in ids))
    out = tmp_path / "out"
    config = validate({"model": {"path": "m"}, "prompts": {"path": str(tmp_path / "p.jsonl")},
                       "saves": [{"location": "logits"}], "output": {"dir": str(out), "shard_size": 2},
                       "runner": {"progress_interval_s": 0.2}})

    def run(fail_on=None):
        monkeypatch.setattr(pipeline, "build_processor", fake_processor(fail_on))
        return pipeline.run_on_ray_data(prepare(config, resolve=False), stream=open(os.devnull, "w"))

    failed = run(fail_on="q13")
    assert not failed.complete and "engine died" in failed.failure and failed.prompts_done < 20
    before = committed_ids(out)
    first = run()
    assert first.complete, first.failure
    assert first.prompts_skipped == before and first.prompts_run == 20 - before
    assert first.prompts_done == 20 and first.duplicates == 0

    # As a driver killed mid-write leaves it: one file's checkpoint still pending; another file never written.
    pending, lost = sorted(committed(out))[:2]
    pending_rows = pq_ids(pending)
    pending.rename(pending.with_name(pending.stem + ".pending.parquet"))
    lost_rows = pq_ids(lost)
    for data in (out / "data").glob(lost.stem + "*.parquet"):
        data.unlink()
    lost.unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("*.parquet")
            if not p.name.startswith(pending.stem)}
    again = run()
    assert again.complete and again.prompts_skipped == 20 - len(pending_rows) - len(lost_rows)
    assert again.prompts_run == len(pending_rows) + len(lost_rows)
    rows = written(out)
    assert sorted(r["id"] for r in rows) == sorted(ids), "every prompt exactly once"
    assert all(r["logits"] == [float(r["id"][1:])] * 3 for r in rows)
    assert not list((out / "data").glob(pending.stem + "*")), "the pending checkpoint's file was deleted"
    assert {name: (out / "data" / name).stat().st_mtime_ns for name in kept} == kept
    assert not list((out / "checkpoint").glob("*.pending.parquet"))


def pq_ids(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path).column("id").to_pylist()


def committed_ids(folder: Path) -> int:
    return sum(len(pq_ids(p)) for p in committed(folder))
