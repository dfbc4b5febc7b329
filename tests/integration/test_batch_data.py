"""``python -m nnsight_ray.batch`` on Ray Data (``nnsight_ray.batch.pipeline``): a real driver process, real Ray
Data, the real vLLM CPU engine on the session's Ray cluster, values against nnsight's in-process engine.

- prompts read by ``ray.data`` (a Parquet file, a ``.txt`` file through ``TextLines``, a ``.jsonl`` file);
- the run's rows equal ``local_llama``'s traces; a prompt vLLM refuses is a row with ``error`` and a line in
  ``errors.jsonl``, and the run goes on;
- the driver SIGKILLed after some files were committed, then the same command again: it resumes through Ray
  Data's checkpointing by prompt id, the files committed before the kill are kept as they were, and every
  prompt is in the output exactly once (counted here from the files, not from the run's own report);
- a third run of the finished folder starts no engine and writes nothing.

Every subprocess is bounded (``timeout``), and so is the wait for the kill point.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ENGINE_KWARGS, assert_close

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


def committed(folder: Path) -> list[Path]:
    return [p for p in (folder / "checkpoint").glob("*.parquet") if not p.name.endswith(".pending.parquet")]


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
    from nnsight_ray.batch.pipeline import check_source, read_dataset

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
        dataset = read_dataset(source)
        assert reads(dataset._logical_plan.dag), "a Read at the root: Ray Data's checkpointing filters it"
        assert sorted(dataset.take_all(), key=str) == sorted(want, key=str)
        assert check_source(source) == 2
    with pytest.raises(BatchConfigError, match=r"no column 'id'"):
        check_source(PromptsConfig(path=str(tmp_path / "p.parquet")))


def test_a_killed_driver_resumes_through_ray_data_checkpointing_with_every_prompt_once(ray_cluster, local_llama,
                                                                                      model_dir, tmp_path):
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

    log = tmp_path / "first.log"
    with open(log, "wb") as handle:
        first = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while len(committed(out)) < 2:
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no two files committed in 300 s"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
    finally:
        if first.poll() is None:
            first.kill()
        first.wait(timeout=60)
    done_before = sum(pq.read_metadata(p).num_rows for p in committed(out))
    assert 8 <= done_before < len(prompts), f"kill the run midway: {done_before} prompts committed"
    kept = {}
    for path in committed(out):  # the data files of committed checkpoints: a rerun must not touch them
        for data in (out / "data").glob(path.stem + "*.parquet"):
            kept[data.name] = (data.stat().st_ino, data.stat().st_mtime_ns)
    assert kept

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=480)
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
    assert "NNsightEngineStageUDF" not in third.stdout + third.stderr, "a finished folder starts no engine"
    assert sorted(p.name for p in (out / "data").iterdir()) == files
