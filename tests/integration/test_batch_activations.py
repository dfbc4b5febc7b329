"""``python -m nnsight_ray.batch`` with ``output.format: activations`` on Ray Data: a real driver process, real Ray
Data, the real vLLM CPU engine on the session's Ray cluster, every token row against nnsight's in-process engine.

- the command's own engine at PP=2 (a ``RayVLLM`` of two ranks in the engine actor's placement group): ``--check``
  says the run takes Ray Data, and where the ranks write; each stage's first rank writes a file of its own
  layers; every prompt's row names its files (one per stage), its ``prompt_index`` in them and its token count, and its rows there (token
  ids, positions, each layer's residual stream) equal ``local_llama``'s;
- a prompt vLLM refuses is a row with ``error`` and no files, and a line in ``errors.jsonl``;
- the files the rows name are exactly the files on disk: one left there by an earlier attempt is deleted once the
  run is complete;
- on the session's ``tp1`` (``--connect``): the driver SIGKILLed after some parts were committed, then the same
  command again: every prompt's token rows are in the files exactly once, and no file is left that no row names.

One engine start (the first test's, two ranks); every subprocess and the wait for the kill point are bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import ENGINE_KWARGS, assert_close, kill_after_commits

pytestmark = pytest.mark.integration

LOCATIONS = ["model.layers.3.output", "model.layers.1.output"]
PROMPTS = ["Hello, world!", "The capital of France is", "1 2 3 4 5", "Hi", "x" * 300, "abc def ghi jkl",
           "Ray and vLLM", "A longer prompt, with punctuation; and digits 0123456789.", "ok ok ok"]
REFUSED = 4  # longer than max_model_len: vLLM refuses it


def reference(local, prompt: str) -> dict[str, torch.Tensor]:
    """Each location's residual stream (hidden + residual) at every prompt token, from the in-process engine."""
    import nnsight

    with local.trace(prompt, temperature=0.0, max_tokens=1):
        values = nnsight.save({})
        for location in sorted(LOCATIONS):  # in the model's order: a trace cannot read a layer that already ran
            out = local.model.layers[int(location.split(".")[2])].output
            values[location] = (out[0] + out[1]).clone()
    return dict(values)


def test_an_activation_dataset_on_ray_data_equals_local_traces(ray_cluster, local_llama, model_dir, tmp_path,
                                                               capsys, monkeypatch):
    import pyarrow.parquet as pq
    from safetensors.numpy import load_file

    from nnsight_ray.batch import __main__ as batch_main

    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out"
    config = {"model": {"path": model_dir}, "engine": {"engine_kwargs": dict(ENGINE_KWARGS), "pipeline_parallel_size": 2},
              "prompts": {"path": str(tmp_path / "prompts.jsonl")},
              "saves": [{"location": location, "tokens": "all"} for location in LOCATIONS],
              "output": {"dir": str(out), "shard_size": 3, "format": "activations"},
              "runner": {"progress_interval_s": 1}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))

    monkeypatch.setattr(batch_main, "_logging", lambda verbose: None)  # no handler left on this process's logger
    assert batch_main.main(["--config", str(path), "--check"]) == 0
    said = capsys.readouterr().out
    assert f"on Ray Data (nnsight_ray.data); the engines' ranks write the activation files into {out}/activations" \
        in said, said

    (out / "activations").mkdir(parents=True)
    (out / "activations" / "part-left-by-a-killed-run.safetensors").write_bytes(b"\0" * 8)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "nnsight_ray.batch", "--config", str(path),
                           "--address", ray_cluster.address], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{len(PROMPTS)} prompts run, 0 already done, 1 errors" in done.stdout and "on Ray Data" in done.stdout
    assert "1 left by an earlier attempt removed" in done.stdout, done.stdout

    rows = {row["id"]: row for row in pq.read_table(out / "data").to_pylist()}
    assert sorted(rows) == sorted(f"q{i}" for i in range(len(PROMPTS))), "every prompt once"
    refused = rows[f"q{REFUSED}"]
    assert refused["error"].startswith("VLLMValidationError") and refused["files"] is None
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["type"]) for e in errors] == [(f"q{REFUSED}", "VLLMValidationError")]

    named = {name for row in rows.values() for name in row["files"] or []}
    assert sorted(named) == sorted(f"activations/{p.name}" for p in (out / "activations").iterdir()), \
        "the files the rows name, and no other"
    assert all(name.startswith("activations/part-") and name.endswith(".safetensors") for name in named)
    files = {name: load_file(str(out / name)) for name in named}
    for index, prompt in enumerate(PROMPTS):
        if index == REFUSED:
            continue
        row = rows[f"q{index}"]
        assert row["error"] is None and len(row["files"]) == 2, row["files"]  # two pipeline stages: a file each
        tokens = local_llama.tokenizer(prompt)["input_ids"]
        want = reference(local_llama, prompt)
        seen = set()
        for name in row["files"]:
            data = files[name]
            mine = data["prompt_index"] == row["prompt_index"]
            assert int(mine.sum()) == row["tokens"] == len(tokens)
            assert data["token_ids"][mine].tolist() == tokens
            assert data["position"][mine].tolist() == list(range(len(tokens)))
            for location in set(LOCATIONS) & set(data):  # layer 1 on stage 0, layer 3 on stage 1
                assert data[location].dtype.name == "float32"  # the model's dtype
                assert_close(torch.from_numpy(data[location][mine]), want[location])
                seen.add(location)
        assert seen == set(LOCATIONS), (row["files"], seen)
    stage0 = [data for name, data in files.items() if ".stage0" in name]
    assert stage0 and sum(len(data["token_ids"]) for data in stage0) == sum(r["tokens"] or 0 for r in rows.values())

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["layout"]["activations"] == "activations/*.safetensors"
    assert manifest["counts"]["activation_files"] == len(named) and manifest["counts"]["orphans_removed"] == 1


def test_a_killed_activation_run_resumes_with_every_token_row_once(ray_cluster, ray_tp1, local_llama, model_dir,
                                                                   tmp_path):
    import pyarrow.parquet as pq
    from safetensors.numpy import load_file

    prompts = [f"resume {i} " + "xyz"[: i % 3] for i in range(48)]
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out"
    # One part of 6 prompts in flight, 16 decode steps each: slow enough to kill between parts.
    config = {"model": {"path": model_dir}, "prompts": {"path": str(tmp_path / "prompts.jsonl")},
              "saves": [{"location": LOCATIONS[0], "tokens": "all"}], "sampling": {"max_tokens": 16},
              "output": {"dir": str(out), "shard_size": 6, "format": "activations"},
              "runner": {"max_in_flight": 6, "prompts_per_trace": 6, "progress_interval_s": 1}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "nnsight_ray.batch", "--config", str(path), "--address", ray_cluster.address,
               "--connect", "tp1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    done_before = kill_after_commits(command, env, tmp_path / "first.log", out, seconds=300)
    assert 12 <= done_before < len(prompts), f"kill the run midway: {done_before} prompts committed"

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"{done_before} already done" in second.stdout and "each once" in second.stdout

    rows = {row["id"]: row for row in pq.read_table(out / "data").to_pylist()}
    assert sorted(rows) == sorted(f"q{i}" for i in range(len(prompts))) and not any(r["error"] for r in rows.values())
    named = {name for row in rows.values() for name in row["files"]}
    assert sorted(named) == sorted(f"activations/{p.name}" for p in (out / "activations").iterdir()), \
        "the files the rows name, and no other (a part the kill cut off is removed)"
    files = {name: load_file(str(out / name)) for name in named}
    assert sum(len(data["token_ids"]) for data in files.values()) == sum(r["tokens"] for r in rows.values()), \
        "every token row once"
    for index, prompt in enumerate(prompts):
        row = rows[f"q{index}"]
        data = files[row["files"][0]]
        mine = data["prompt_index"] == row["prompt_index"]
        tokens = local_llama.tokenizer(prompt)["input_ids"]
        assert int(mine.sum()) == row["tokens"] == len(tokens)
        assert data["token_ids"][mine].tolist() == tokens
        if index in (0, 31, 47):
            assert_close(torch.from_numpy(data[LOCATIONS[0]][mine]), reference(local_llama, prompt)[LOCATIONS[0]])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and [r["status"] for r in manifest["runs"]] == ["running", "complete"]
