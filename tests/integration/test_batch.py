"""``run_batch(...)`` end to end, on the session's Ray cluster and engines, checked against LocalVLLM.

``run_batch`` builds the same Ray Data pipeline as the command line (test_batch_data.py,
test_batch_activations.py), here on running ``RayVLLM`` deployments handed in (``engines=[...]``):

- rows equal ``LocalVLLM`` traces of the same prompts (TP=2 over two Ray nodes, and through ``ray job submit``
  on a ``ray start --head`` cluster this module starts and stops itself); a rerun runs nothing;
- activation datasets in the model's dtype and float16, with generated tokens (greedy and sampled);
- two engines give the same rows as one;
- a failing or runaway intervention is one prompt's error, the run goes on;
- a driver killed with engines of its own takes their actors and groups with it;
- bad inputs (an output folder that cannot be written among them) fail before any engine starts;
- the documented ``--local-cluster`` command, in a fresh process, and ``nnsight-ray submit``.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ENGINE_KWARGS, assert_close, committed_checkpoints
from ray_head import free_ports, nnsight_ray_command, stop_processes, submit_batch

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 4
PROMPTS = ["Hello, world!", "The capital of France is", "1 2 3 4 5", "Hi", "abc def ghi jkl",
           "Ray and vLLM", "x", "A longer prompt, with punctuation; and digits 0123456789.",
           "seven!!", "Tensor parallel", "ok ok ok"]


# --------------------------------------------------------------------------- helpers


_REFERENCES: dict[str, dict[str, torch.Tensor]] = {}


def reference(local, prompt: str) -> dict[str, torch.Tensor]:
    """Every layer's residual stream (all tokens) and the logits, from nnsight's in-process engine."""
    if prompt not in _REFERENCES:
        import nnsight

        with local.trace(prompt, temperature=0.0, max_tokens=1):
            values = nnsight.save([])
            for i in range(LAYERS):
                out = local.model.layers[i].output
                values.append((out[0] + out[1]).clone())
            logits = local.logits.clone().save()
        _REFERENCES[prompt] = {**{f"model.layers.{i}.output": values[i] for i in range(LAYERS)},
                               "logits": logits[-1]}
    return _REFERENCES[prompt]


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def make_config(tmp_path: Path, model_dir: str, prompts: list[str], name: str = "out", **sections) -> dict:
    data = {
        "model": {"path": model_dir},
        "engine": {"engine_kwargs": dict(ENGINE_KWARGS)},
        "prompts": {"path": str(write_prompts(tmp_path / f"{name}-prompts.jsonl", prompts))},
        # Listed out of model order on purpose: the run reads them in execution order.
        "saves": [{"location": "logits"}, {"location": "model.layers.3.output"},
                  {"location": "model.layers.1.output", "tokens": "all"}, {"location": "model.layers.0.output"},
                  {"location": "model.layers.2.output"}],
        "output": {"dir": str(tmp_path / name), "shard_size": 4},
        "runner": {"max_in_flight": 6, "prompts_per_trace": 3, "progress_interval_s": 0.1},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) and key != "saves" else value
    return data


def run(config_dict: dict, **kwargs):
    from nnsight_ray.batch import run_batch
    from nnsight_ray.batch.config import validate

    stream = io.StringIO()
    result = run_batch(validate(config_dict), stream=stream, interactive=False, **kwargs)
    return result, stream.getvalue()


def rows(folder: Path) -> list[dict]:
    """The run's rows, by prompt id."""
    import pyarrow.parquet as pq

    out = [row for path in sorted((folder / "data").glob("*.parquet")) for row in pq.read_table(path).to_pylist()]
    return sorted(out, key=lambda row: int(row["id"][1:]))


def errors_of(folder: Path) -> dict[str, dict]:
    return {e["id"]: e for e in map(json.loads, (folder / "errors.jsonl").read_text().splitlines())}


def value(row: dict, name: str) -> torch.Tensor:
    return torch.tensor(row[name], dtype=torch.float32).reshape(row[name + ".shape"])


def check_against_local(local, row: dict, saves: list[dict]) -> None:
    want = reference(local, row["prompt"])
    for save in saves:
        name = save["location"]
        expected = want[name] if save.get("tokens") == "all" or name == "logits" else want[name][-1]
        assert_close(value(row, name), expected)


# --------------------------------------------------------------------------- values


def test_rows_on_a_running_tp2_engine_equal_local_traces(ray_tp2, local_llama, model_dir, tmp_path):
    config = make_config(tmp_path, model_dir, PROMPTS)
    result, log = run(config, engines=[ray_tp2])
    assert result.complete and result.prompts_run == len(PROMPTS) and result.errors == 0, result.summary()
    assert "prompts/s" in log and "on Ray Data" in result.summary()

    got = rows(tmp_path / "out")
    assert [r["id"] for r in got] == [f"q{i}" for i in range(len(PROMPTS))]
    for row in got:
        assert row["error"] is None
        check_against_local(local_llama, row, config["saves"])
    assert value(got[0], "model.layers.1.output").shape == (len("Hello, world!"), 128)
    assert value(got[0], "logits").shape == (99,)

    manifest = json.loads(result.manifest.read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["prompts_done"] == len(PROMPTS)
    assert {"nnsight", "ray", "torch", "pyarrow"} <= set(manifest["versions"])
    assert manifest["runs"][-1]["connected"] == ["tp2"]
    assert (tmp_path / "out" / "errors.jsonl").read_text() == ""
    assert len(ray_tp2.topology()) == 2, "the engine handed in keeps running after the run"

    again, _ = run(config, engines=[ray_tp2])
    assert again.prompts_run == 0 and again.prompts_skipped == len(PROMPTS) and again.complete


def token_rows(folder: Path, row: dict) -> dict:
    """One prompt's token rows of an activation run, as a trainer reads them: its row's files, safetensors, numpy."""
    import numpy
    from safetensors.numpy import load_file

    parts = [load_file(str(folder / name)) for name in row["files"]]
    mine = [part["prompt_index"] == row["prompt_index"] for part in parts]
    return {key: numpy.concatenate([part[key][m] for part, m in zip(parts, mine)]) for key in parts[0]}


ACTIVATIONS = [{"location": "model.layers.3.output", "tokens": "all"},
               {"location": "model.layers.1.output", "tokens": "all"}]


def test_activation_datasets_on_a_running_tp2_engine_equal_local_traces(ray_tp2, local_llama, model_dir, tmp_path):
    """output.format=activations: token-major safetensors the ranks write, in the model's dtype or float16, and
    with output.generated one row per generated token that ran, greedy or sampled."""
    config = make_config(tmp_path, model_dir, PROMPTS[:4], saves=ACTIVATIONS, output={"format": "activations"},
                         runner={})
    result, log = run(config, engines=[ray_tp2])
    assert result.complete and result.prompts_run == 4 and result.errors == 0, log
    assert result.activation_files and "activations/*.safetensors" in result.summary()
    for row in rows(tmp_path / "out"):
        data = token_rows(tmp_path / "out", row)
        tokens = local_llama.tokenizer(row["prompt"])["input_ids"]
        assert row["tokens"] == len(tokens) and data["token_ids"].tolist() == tokens
        assert data["position"].tolist() == list(range(len(tokens)))
        for save in ACTIVATIONS:
            assert data[save["location"]].dtype.name == "float32"  # the model's dtype ("auto")
            assert_close(torch.from_numpy(data[save["location"]]), reference(local_llama, row["prompt"])[save["location"]])

    half = make_config(tmp_path, model_dir, PROMPTS[:2], name="half", saves=ACTIVATIONS[:1],
                       output={"format": "activations", "dtype": "float16"}, runner={})
    run(half, engines=[ray_tp2])
    row = rows(tmp_path / "half")[1]
    data = token_rows(tmp_path / "half", row)
    assert data["model.layers.3.output"].dtype.name == "float16"
    assert_close(torch.from_numpy(data["model.layers.3.output"].astype("float32")),
                 reference(local_llama, row["prompt"])["model.layers.3.output"], rel=2e-3)

    # output.generated: each prompt's rows, then one per generated token that ran (max_tokens 3: two, fewer where
    # decoding meets the end of sequence first), each equal to one prefill of the whole sequence in-process:
    # greedy (the tokens LocalVLLM's own greedy decoding gives) and sampled (whatever was sampled)
    for name, sampling in (("gen", {"max_tokens": 3}), ("sampled", {"max_tokens": 3, "temperature": 1.0})):
        config = make_config(tmp_path, model_dir, PROMPTS[:3], name=name, saves=ACTIVATIONS[:1], sampling=sampling,
                             output={"format": "activations", "generated": True}, runner={})
        result, log = run(config, engines=[ray_tp2])
        assert result.complete and result.errors == 0, log
        for row in rows(tmp_path / name):
            data = token_rows(tmp_path / name, row)
            sequence = data["token_ids"].tolist()
            tokens = local_llama.tokenizer(row["prompt"])["input_ids"]
            assert sequence[:len(tokens)] == tokens and len(tokens) <= len(sequence) <= len(tokens) + 2
            assert data["position"].tolist() == list(range(len(sequence))) and row["tokens"] == len(sequence)
            if name == "gen":
                with local_llama.trace(row["prompt"], temperature=0.0, max_tokens=3) as tracer:
                    greedy = tracer.result.save()
                assert sequence == tokens + list(greedy.outputs[0].token_ids)[:-1]
            with local_llama.trace({"prompt_token_ids": sequence}, temperature=0.0, max_tokens=1):
                out = local_llama.model.layers[3].output
                want = (out[0] + out[1]).clone().save()
            assert_close(torch.from_numpy(data["model.layers.3.output"]), want)


def test_two_engines_give_the_same_rows_as_one(ray_tp1, ray_tp2, model_dir, tmp_path):
    prompts = [f"prompt {i}: " + "abcdefgh"[: i % 8] for i in range(24)]
    one = make_config(tmp_path, model_dir, prompts, name="one", runner={"max_in_flight": 4, "prompts_per_trace": 2})
    two = make_config(tmp_path, model_dir, prompts, name="two", runner={"max_in_flight": 4, "prompts_per_trace": 2})
    run(one, engines=[ray_tp1])
    result, _ = run(two, engines=[ray_tp1, ray_tp2])
    assert result.complete
    assert json.loads(result.manifest.read_text())["runs"][-1]["connected"] == ["tp1", "tp2"]
    a, b = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["id"] for r in a] == [r["id"] for r in b] == [f"q{i}" for i in range(24)]
    for x, y in zip(a, b):
        for save in one["saves"]:
            assert_close(value(y, save["location"]), value(x, save["location"]))


def test_a_runaway_intervention_fails_its_prompt_alone(ray_tp2, local_llama, model_dir, tmp_path):
    """``intervene`` spinning on one prompt: the engine stops it after its block_timeout_s (5 s on tp2), that
    prompt is recorded in errors.jsonl as a BlockTimeoutError, and every other prompt's row is exact."""
    intervention = tmp_path / "iv.py"
    intervention.write_text(
        "def intervene(model, tracer):\n"
        "    hidden = model.model.layers[2].output[0]\n"
        "    if hidden.shape[0] == 7:\n"
        "        while True:\n"
        "            pass\n"
        "    return {'h2': hidden[-1]}\n"
    )
    prompts = ["Hello, world!", "seven!!", "1 2 3 4 5", "Hi"]
    config = make_config(tmp_path, model_dir, prompts, saves=None, intervention=str(intervention))
    result, _ = run(config, engines=[ray_tp2])
    assert result.complete and result.errors == 1
    errors = errors_of(tmp_path / "out")
    assert set(errors) == {"q1"} and errors["q1"]["type"] == "BlockTimeoutError"
    assert "block_timeout_s=5 " in errors["q1"]["message"]
    for row in rows(tmp_path / "out"):
        if row["id"] == "q1":
            assert row["error"].startswith("BlockTimeoutError") and row.get("h2") is None
            continue
        with local_llama.trace(row["prompt"], temperature=0.0, max_tokens=1):
            h2 = local_llama.model.layers[2].output[0][-1].clone().save()
        assert_close(value(row, "h2"), h2)


def test_failing_interventions_are_recorded_and_the_run_goes_on(ray_tp1, local_llama, model_dir, tmp_path):
    intervention = tmp_path / "iv.py"
    intervention.write_text(
        "import torch\n\n"
        "def intervene(model, tracer):\n"
        "    hidden = model.model.layers[2].output[0]\n"
        "    if hidden.shape[0] == 7:\n"
        "        raise ValueError(f'seven tokens: {hidden.shape[0]}')\n"
        "    return {'h2': hidden[-1], 'top': model.logits[-1].argmax()}\n"
    )
    prompts = ["Hello, world!", "seven!!", "1 2 3 4 5", "Hi", "7 chars", "ok", "x" * 300]
    config = make_config(tmp_path, model_dir, prompts, saves=None, intervention=str(intervention))
    result, _ = run(config, engines=[ray_tp1])
    assert result.complete and result.errors == 3

    errors = errors_of(tmp_path / "out")
    assert set(errors) == {"q1", "q4", "q6"}
    assert errors["q1"]["type"] == "ValueError" and errors["q1"]["message"] == "seven tokens: 7"
    assert re.search("maximum (context|model) length", errors["q6"]["message"]), errors["q6"]
    for row in rows(tmp_path / "out"):
        if row["id"] in errors:
            assert row["error"].startswith(errors[row["id"]]["type"]) and row.get("h2") is None
            continue
        want = reference(local_llama, row["prompt"])
        # layers[2].output[0] is the layer's hidden part (not the residual sum): compare via its own trace.
        with local_llama.trace(row["prompt"], temperature=0.0, max_tokens=1):
            h2 = local_llama.model.layers[2].output[0][-1].clone().save()
        assert_close(value(row, "h2"), h2)
        assert value(row, "top").item() == want["logits"].argmax().item()


# --------------------------------------------------------------------------- a killed driver


def test_a_killed_driver_with_engines_of_its_own_leaves_no_actor_and_no_reservation(ray_cluster, model_dir,
                                                                                       tmp_path):
    """SIGKILL of a driver running ``run_batch`` with an engine of its own (an activation dataset: the engine's
    ranks are actors, ``data-<id>``, in the Ray Data actor's placement group): Ray takes the pool's actors, the
    engine and the group with the driver's job, as it takes a user's own ``RayVLLM`` (non-detached actors and
    groups go with their owner). A rerun's resume: test_batch_data.py, test_batch_activations.py."""
    import ray

    def held() -> tuple[set[str], set[str]]:
        actors = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("data-")}
        groups = {key for key, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}
        return actors, groups

    before = held()
    prompts = [f"orphan {i}" for i in range(400)]
    config = make_config(tmp_path, model_dir, prompts, saves=ACTIVATIONS[:1], sampling={"max_tokens": 8},
                         output={"dir": str(tmp_path / "out"), "shard_size": 4, "format": "activations"},
                         runner={"max_in_flight": 4, "progress_interval_s": 1})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    script = ("import sys\n"
              "from nnsight_ray._internal.cluster.placement import connect_ray\n"
              "from nnsight_ray.batch import load_config, run_batch\n"
              "connect_ray(sys.argv[2])\n"
              "run_batch(load_config(sys.argv[1]))\n")
    command = [sys.executable, "-c", script, str(path), ray_cluster.address]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    log = tmp_path / "driver.log"
    with open(log, "wb") as handle:
        driver = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while not committed_checkpoints(tmp_path / "out"):  # its engine is up and has written a part
            assert driver.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no part committed in 400 s: " + log.read_text()[-2000:]
            time.sleep(0.2)
        actors, groups = (new - old for new, old in zip(held(), before))
        assert actors and groups, f"the driver's engine is not where it was looked for: {held()}"
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
        deadline = time.monotonic() + 60
        while (actors | groups) & set().union(*held()):
            assert time.monotonic() < deadline, f"left behind 60 s after the driver died: {held()}"
            time.sleep(1)
    finally:
        if driver.poll() is None:  # a failed check above must not leave a driver running
            driver.kill()
            driver.wait(timeout=60)


# --------------------------------------------------------------------------- bad inputs


@pytest.fixture
def no_engines(monkeypatch):
    from nnsight_ray._internal import deploy
    from nnsight_ray.batch import pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(pipeline, "run_on_ray_data", refuse)
    monkeypatch.setattr(deploy, "launch", refuse)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"saves": [{"location": "model.layers.10.output"}]},
         "saves.0.location 'model.layers.10.output': 'model.layers' has no submodule '10' (its children: 0, 1, 2, 3)"),
        ({"saves": [{"location": "transformer.h.0.output"}]}, "the model has no submodule 'transformer'"),
        ({"prompts": {"path": "/nonexistent/prompts.jsonl"}}, "prompts.path '/nonexistent/prompts.jsonl': no such file"),
        ({"engine": {"engine_kwargs": {"max_model_lenght": 256}}},
         "unknown vLLM engine argument(s) 'max_model_lenght' (did you mean 'max_model_len'?)"),
        ({"engine": {"engine_kwargs": {"taps": ["model.layers.*.output"], "enforce_eager": True}}},
         "engine.engine_kwargs: enforce_eager=True contradicts taps"),
        ({"engine": {"engine_kwargs": {"taps": ["model.layer.*.output"]}}},
         "engine.engine_kwargs.taps: Tap 'model.layer.*.output' names no module"),
        ({"engine": {"engine_kwargs": {"taps": ["model.layers.0.self_attn.source.nope_0.output"]}}},
         "engine.engine_kwargs.taps: Tap on model.model.layers.0.self_attn.source: its forward has no operation "
         "'nope_0'. Its operations are ['self_qkv_proj_0'"),
        ({"model": {"path": "/nonexistent/model"}}, "model.path '/nonexistent/model': no such folder"),
        ({"engine": {"engine_kwargs": {"block_timeout_s": 900}}},
         "engine.engine_kwargs: block_timeout_s=900 is above max_block_timeout_s=600"),
    ],
)
def test_bad_inputs_fail_before_any_engine_starts(no_engines, model_dir, tmp_path, change, needle):
    from nnsight_ray.batch.errors import BatchConfigError

    config = make_config(tmp_path, model_dir, PROMPTS)
    config.update(change)
    with pytest.raises(BatchConfigError) as error:
        run(config)
    assert needle in str(error.value)
    assert not (tmp_path / "out").exists(), "nothing was written"


def test_syntax_error_in_the_intervention_fails_before_any_engine_starts(no_engines, model_dir, tmp_path):
    from nnsight_ray.batch.errors import BatchConfigError

    bad = tmp_path / "iv.py"
    bad.write_text("def intervene(model, tracer):\n    return {'h': model.model.layers[0].output[0]\n")
    config = make_config(tmp_path, model_dir, PROMPTS, saves=None, intervention=str(bad))
    with pytest.raises(BatchConfigError, match=r"iv.py.*syntax error at line 2"):
        run(config)


def test_cli_reports_a_bad_module_path_with_exit_code_2(model_dir, tmp_path):
    config = make_config(tmp_path, model_dir, PROMPTS, saves=[{"location": "model.layers.4.output"}])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-m", "nnsight_ray.batch", "--config", str(path), "--set", "engine.replicas=2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "'model.layers' has no submodule '4' (its children: 0, 1, 2, 3)" in done.stderr
    assert "starting engine replica" not in done.stderr and "Connected to Ray" not in done.stderr


def unwritable(tmp_path: Path, case: str, monkeypatch) -> tuple[Path, str]:
    """An ``output.dir`` a run cannot write, and what the error must say of it."""
    if case == "below a file":
        (tmp_path / "afile").write_text("not a folder")
        return tmp_path / "afile" / "out", f"{str(tmp_path / 'afile')!r} on its path is a file, not a folder"
    if case == "a file":
        (tmp_path / "out").write_text("not a folder")
        return tmp_path / "out", "it is a file, not a folder"
    folder = tmp_path / "out"
    folder.mkdir()
    if case == "read-only":
        folder.chmod(0o500)
        return folder, "cannot write there (PermissionError"
    # As root, permission bits stop no write: the probe is refused as the kernel would refuse it.
    import tempfile

    real = tempfile.TemporaryFile

    def refused(*args, dir=None, **kwargs):
        if Path(dir or ".") == folder:
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    return folder, "cannot write there (PermissionError: Permission denied)"


@pytest.mark.parametrize("case", ["below a file", "a file", "refused", pytest.param("read-only", marks=pytest.mark.skipif(
    os.geteuid() == 0, reason="as root, permission bits stop no write"))])
def test_an_output_folder_that_cannot_be_written_fails_before_any_engine_starts(no_engines, model_dir, tmp_path,
                                                                                monkeypatch, case):
    from nnsight_ray.batch.errors import BatchConfigError

    folder, needle = unwritable(tmp_path, case, monkeypatch)
    config = make_config(tmp_path, model_dir, PROMPTS, output={"dir": str(folder)})
    try:
        with pytest.raises(BatchConfigError) as error:
            run(config)
    finally:
        if case == "read-only":
            folder.chmod(0o700)
    assert f"output.dir {str(folder)!r}: {needle}" in str(error.value)
    assert "manifest.json" not in str(error.value)


def test_check_refuses_an_output_folder_below_a_file_with_exit_code_2(model_dir, tmp_path):
    """``--check`` says what a run would meet: not "config OK" for a folder below a file."""
    (tmp_path / "afile").write_text("not a folder")
    config = make_config(tmp_path, model_dir, PROMPTS, output={"dir": str(tmp_path / "afile" / "out")})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-m", "nnsight_ray.batch", "--config", str(path), "--check"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "config OK" not in done.stdout and "Traceback" not in done.stderr
    assert f"{str(tmp_path / 'afile')!r} on its path is a file, not a folder" in done.stderr
    assert str(tmp_path / "afile" / "out") in done.stderr and "manifest.json" not in done.stderr


def test_a_folder_resumes_only_for_the_same_output_settings(model_dir, tmp_path):
    """The run's fingerprint holds an activation dataset's format, dtype and (when set) ``generated``: a folder of
    other settings is refused, not mixed; a Parquet run's fingerprint has none of them (older folders resume)."""
    from nnsight_ray.batch.config import validate
    from nnsight_ray.batch.errors import BatchConfigError
    from nnsight_ray.batch.preflight import prepare

    parquet = prepare(validate(make_config(tmp_path, model_dir, PROMPTS)), resolve=False)
    assert not {"format", "dtype", "generated"} & set(parquet.run_dir.fingerprint)
    half = prepare(validate(make_config(tmp_path, model_dir, PROMPTS, saves=ACTIVATIONS, runner={},
                                        output={"format": "activations", "dtype": "float16"})), resolve=False)
    assert {k: half.run_dir.fingerprint[k] for k in ("format", "dtype")} == {"format": "activations",
                                                                              "dtype": "float16"}
    assert "generated" not in half.run_dir.fingerprint
    half.run_dir.prepare()
    half.run_dir.write_atomic(half.run_dir.manifest_path, json.dumps({"fingerprint": half.run_dir.fingerprint}).encode())
    with pytest.raises(BatchConfigError, match=r"different inputs \(changed: dtype, generated, sampling\)"):
        prepare(validate(make_config(tmp_path, model_dir, PROMPTS, saves=ACTIVATIONS, sampling={"max_tokens": 3},
                                     runner={}, output={"format": "activations", "generated": True})), resolve=False)


def test_local_cluster_keeps_ray_on_loopback_before_the_preflight_imports_it(monkeypatch, model_dir, tmp_path):
    """``--local-cluster``: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is in place (and Ray's copy of it, where Ray
    was imported first) before the preflight, which imports vLLM and with it Ray, runs."""
    import argparse

    import ray._private.ray_constants as constants

    from nnsight_ray.batch import __main__ as batch_main, preflight
    from nnsight_ray.batch.errors import BatchConfigError

    seen = {}

    def prepare(config, config_file):
        seen.update(env=os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"), cluster=constants.ENABLE_RAY_CLUSTER)
        raise BatchConfigError("stopped before anything starts")

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr(constants, "ENABLE_RAY_CLUSTER", True)  # a Ray imported without the variable
    monkeypatch.setattr(preflight, "prepare", prepare)
    monkeypatch.setattr(batch_main, "_logging", lambda verbose: None)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_config(tmp_path, model_dir, PROMPTS)))
    args = batch_main.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--config", str(path), "--local-cluster", "3"])
    assert batch_main.run_from_args(args) == 2
    assert seen == {"env": "0", "cluster": False}


def test_the_documented_local_cluster_command_runs_in_a_fresh_process(model_dir, tmp_path):
    """docs/batch.md's first command, ``python -m nnsight_ray.batch --config cluster_configs/batch-demo.yaml
    --local-cluster 3``, from the repository root in a shell that says nothing of Ray (a fresh clone): it once
    hung for minutes, its driver dialling the machine's external address. Smaller here (``--set``): the session's
    checkpoint, four prompts, one rank (so the Ray Data path: docs/batch.md's second command), the tests' KV cache."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:4])
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    command = [sys.executable, "-m", "nnsight_ray.batch", "--config", "cluster_configs/batch-demo.yaml",
               "--local-cluster", "3", "--set", f"model.path={model_dir}", "--set", f"prompts.path={prompts}",
               "--set", f"output.dir={tmp_path / 'out'}", "--set", "engine.tensor_parallel_size=1",
               "--set", f"engine.engine_kwargs.kv_cache_memory_bytes={ENGINE_KWARGS['kv_cache_memory_bytes']}"]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"no answer in 420 s: {(error.stderr or b'')[-3000:]!r}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "batch done: 4 prompts run" in done.stdout and "on Ray Data" in done.stdout  # TP=1: the Ray Data path
    import pyarrow.parquet as pq

    assert sorted(pq.read_table(tmp_path / "out" / "data").column("id").to_pylist()) == [f"q{i}" for i in range(4)]


def test_submit_refuses_a_bad_config_before_contacting_any_cluster(tmp_path):
    """``nnsight-ray submit`` checks the config here first: exit 2, the key named, no job."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "prompts": {"path": "p.jsonl"},
                                    "saves": [{"location": "logits"}], "output": {"dir": str(tmp_path / "out")},
                                    "runner": {"max_in_flihgt": 4}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(nnsight_ray_command("submit", "--config", str(path), "--no-working-dir",
                                              "--address", "http://127.0.0.1:9"),
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "max_in_flihgt" in done.stderr and "submitted job" not in done.stdout


# --------------------------------------------------------------------------- ray job submit


@pytest.fixture
def head_node():
    """``ray start --head`` on 127.0.0.1 with its own ports and temp dir; stopped by killing only its processes."""
    temp_dir = tempfile.mkdtemp(prefix="nrjob", dir="/tmp")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           # Job entrypoints run with the raylet's PATH: `python` is this venv's.
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           # A loopback-only test cluster: no token auth, whatever ~/.ray/auth_token holds
           # (Ray 2.60 turns it on for `ray start` when that file exists).
           "RAY_AUTH_MODE": "disabled",
           # How long the raylet waits for its agents (nnsight_ray._internal.cluster.local_cluster).
           "RAY_raylet_start_wait_time_s": "120"}
    env.pop("RAY_ADDRESS", None)
    needles = [temp_dir]
    try:
        for attempt in range(3):  # Ray gives a raylet 30 s to register: a busy machine can miss that
            (gcs, dashboard, node_manager, object_manager, agent, agent_grpc, runtime_env, metrics,
             client) = free_ports(9)
            needles += [f"127.0.0.1:{gcs}", f"gcs_server_port={gcs}"]
            command = [
                sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--node-ip-address=127.0.0.1",
                f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                "--include-dashboard=true", f"--node-manager-port={node_manager}",
                f"--object-manager-port={object_manager}", f"--dashboard-agent-listen-port={agent}",
                f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
                f"--metrics-export-port={metrics}", f"--ray-client-server-port={client}", "--num-cpus=4",
                "--num-gpus=0", f"--temp-dir={temp_dir}", "--disable-usage-stats",
            ]
            started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
            if started.returncode == 0:
                break
            stop_processes(needles)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield {"dashboard": f"http://127.0.0.1:{dashboard}", "gcs": f"127.0.0.1:{gcs}", "env": env}
    finally:
        stop_processes(needles)
        subprocess.run(["rm", "-rf", temp_dir], check=False)


def test_ray_job_submit_writes_rows_equal_to_local_traces(head_node, local_llama, model_dir, tmp_path):
    """A job whose prompts are a Parquet object on S3 (a server on loopback), reached through ``--env``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from object_store import s3_server

    prompts = PROMPTS[:6]
    config = make_config(tmp_path, model_dir, prompts, engine={"replicas": 1, "placement_strategy": "PACK"},
                         runner={"max_in_flight": 4, "prompts_per_trace": 2, "progress_interval_s": 1})
    config["prompts"] = {"path": "s3://prompts/run/prompts.parquet"}
    with s3_server() as (s3_env, s3):
        pq.write_table(pa.table({"id": [f"q{i}" for i in range(len(prompts))], "prompt": prompts}),
                       "prompts/run/prompts.parquet", filesystem=s3)
        # one Parquet footer reader, not 32 actors for one object (docs/ci.md)
        done = submit_batch(head_node["dashboard"], config, tmp_path, head_node["env"],
                            job_env={**s3_env, "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1"})
    assert "SUCCEEDED" in done.stdout and "batch done" in done.stdout and "on Ray Data" in done.stdout
    assert "(6 of 6 prompts, each once)" in done.stdout, done.stdout[-3000:]
    # values per prompt run as a Ray Data pipeline: its rows are under out/data (test_batch_data.py)
    got = sorted((row for path in sorted((tmp_path / "out" / "data").glob("*.parquet"))
                  for row in pq.read_table(path).to_pylist()), key=lambda row: row["id"])
    assert [r["id"] for r in got] == [f"q{i}" for i in range(len(prompts))]
    for row in got:
        assert not row["error"], row["error"]
        check_against_local(local_llama, row, config["saves"])
