"""The batch runner's pure parts: config schema and overrides, inputs, saves, scheduler, shards.

Everything a config can get wrong must fail before any engine starts, with
the key or file named; these tests check that without Ray (``ray.init``
raises) and without vLLM (the meta-tree check runs on a stand-in module tree).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import yaml

from nnsight_ray.batch.config import BatchConfig, apply_overrides, load_config, validate
from nnsight_ray.batch.errors import BatchConfigError
from nnsight_ray.batch.interventions import SaveRead, load_intervention, resolve_saves, to_residual
from nnsight_ray.batch.preflight import prepare
from nnsight_ray.batch.progress import Progress
from nnsight_ray.batch.prompts import Prompt, read_prompts
from nnsight_ray.batch.run_dir import RunDir
from nnsight_ray.data.columns import error_info

ROOT = Path(__file__).resolve().parents[2]
BATCH_DEMO = ROOT / "cluster_configs" / "batch-demo.yaml"


def minimal(tmp_path: Path, **sections) -> dict:
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"hello {i}"}) + "\n" for i in range(10)))
    data = {
        "model": {"path": str(tmp_path / "model")},
        "prompts": {"path": str(prompts)},
        "saves": [{"location": "model.layers.1.output"}, {"location": "logits"}],
        "output": {"dir": str(tmp_path / "out"), "shard_size": 4},
    }
    data.update(sections)
    return data


def write_config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# --------------------------------------------------------------------------- schema


def test_demo_config_loads_with_defaults_filled(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_config(BATCH_DEMO)
    assert config.engine.tensor_parallel_size == 2 and config.engine.world_size == 2
    assert config.engine.placement_strategy == "STRICT_SPREAD"
    assert [s.location for s in config.saves][-1] == "logits"
    assert config.runner.max_in_flight == 256 and config.runner.prompts_per_trace == 32


def test_demo_prompts_file_is_the_demo_modules_prompts():
    from nnsight_ray.demo import demo_prompts

    rows = [json.loads(line) for line in (ROOT / "cluster_configs" / "demo-prompts.jsonl").read_text().splitlines()]
    assert rows == demo_prompts() and len(rows) == 64


@pytest.mark.parametrize(
    "override,needle,allowed",
    [
        ("engine.tensor_paralel_size=2", "'engine.tensor_paralel_size' (did you mean 'engine.tensor_parallel_size'?)",
         "tensor_parallel_size, pipeline_parallel_size, placement_strategy"),
        ("outptu={dir: x}", "unknown key 'outptu' (did you mean 'output'?)", "model, engine, prompts, saves"),
        ("saves.1.token=all", "unknown key 'saves.1.token' (did you mean 'saves.1.tokens'?)", "location, tokens"),
        ("sampling.top_p=0.9", "unknown key 'sampling.top_p'", "max_tokens, temperature"),
    ],
)
def test_unknown_keys_are_named_with_the_allowed_ones(tmp_path, override, needle, allowed):
    path = write_config(tmp_path, minimal(tmp_path))
    with pytest.raises(BatchConfigError) as error:
        load_config(path, [override])
    assert needle in str(error.value) and allowed in str(error.value)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("engine.replicas=0", "engine.replicas: Input should be greater than or equal to 1 (got 0)"),
        ("engine.placement_strategy=SPREADY", "engine.placement_strategy"),
        ("saves.0.tokens=first", "saves.0.tokens: Input should be 'last' or 'all'"),
        ("saves.0.location=model.layers.1", "ending in '.output' or '.input'"),
        ("prompts.path=prompts.csv", ".jsonl, .txt, .parquet"),
        ("intervention=x.py", "exactly one of `saves`"),
        ("saves=[]", "exactly one of `saves`"),
        ("engine.engine_kwargs.tensor_parallel_size=2", "use engine.tensor_parallel_size"),
        ("engine.engine_kwargs.model=/x", "use model.path"),
        ("runner.prompts_per_trace=512", "exceeds max_in_flight"),
        ("saves=[{location: logits}, {location: model.logits}]", "'logits' is listed twice"),
        ("model=null", "model"),
    ],
)
def test_bad_values_say_where_and_why(tmp_path, override, needle):
    path = write_config(tmp_path, minimal(tmp_path))
    with pytest.raises(BatchConfigError, match="batch config") as error:
        load_config(path, [override])
    assert needle in str(error.value)


ACTIVATION_SAVES = [{"location": "model.layers.1.output", "tokens": "all"}]


@pytest.mark.parametrize(
    "sections, needle",
    [
        ({}, "give '<module>.output' with tokens: all"),  # minimal's saves: last token, and logits
        ({"saves": [{"location": "model.layers.1.input", "tokens": "all"}]}, "keeps module outputs"),
        ({"saves": None, "intervention": "x.py"}, "an `intervention` file needs output.format=parquet"),
        ({"saves": ACTIVATION_SAVES, "runner": {"max_in_flight": 2, "prompts_per_trace": 1}},
         "below output.shard_size"),
        ({"saves": ACTIVATION_SAVES, "output": {"generated": True}, "sampling": {"max_tokens": 1}},
         "raise sampling.max_tokens"),
    ],
)
def test_activations_refuse_what_they_cannot_write(tmp_path, sections, needle):
    data = {**minimal(tmp_path), **sections}
    data["output"] = {**minimal(tmp_path)["output"], **data["output"], "format": "activations"}
    with pytest.raises(BatchConfigError) as error:
        validate(data)
    assert needle in str(error.value)


def test_activations_defaults_keep_a_gpu_engine_busy(tmp_path):
    data = {**minimal(tmp_path), "saves": ACTIVATION_SAVES}
    data["output"] = {**data["output"], "format": "activations", "shard_size": 64}
    config = validate(data)
    assert config.activations and config.output.dtype == "auto"
    assert config.max_in_flight() == 8 * 64  # not the parquet runner's 256
    data["runner"] = {"max_in_flight": 100}
    assert validate(data).max_in_flight() == 100  # as set
    plain = validate(minimal(tmp_path))
    assert not plain.activations and plain.max_in_flight() == 256
    for setting in ({"dtype": "float16"}, {"generated": True}):
        with pytest.raises(BatchConfigError, match="output.generated apply to output.format=activations"):
            validate({**minimal(tmp_path), "output": {"dir": str(tmp_path / "o"), **setting}})
    data.update(sampling={"max_tokens": 8}, output={**data["output"], "generated": True})
    assert validate(data).output.generated


def test_rank_capture_reads_the_residual_stream():
    from nnsight_ray._internal.extract.capture import capture

    hidden, res = torch.randn(5, 4), torch.randn(5, 4)
    rows = torch.tensor([1, 3])
    assert torch.equal(capture((hidden, res), rows), (hidden + res)[rows])
    assert torch.equal(capture(hidden, rows), hidden[rows])
    assert torch.equal(capture((hidden, torch.randn(2)), rows), hidden[rows])  # not a pair: the first


def test_missing_required_sections(tmp_path):
    data = minimal(tmp_path)
    del data["prompts"]
    with pytest.raises(BatchConfigError, match="prompts: required key missing"):
        validate(data)


def test_unreadable_or_non_mapping_files(tmp_path):
    with pytest.raises(BatchConfigError, match="cannot read it"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(BatchConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(BatchConfigError, match="expected a mapping"):
        load_config(bad)


def test_overrides_parse_yaml_values_and_index_lists(tmp_path):
    data = minimal(tmp_path)
    out = apply_overrides(data, [
        "engine.replicas=2", "engine.engine_kwargs.max_model_len=512", "saves.0.tokens=all",
        "sampling.temperature=0.5", "output.dir=/tmp/x y", "engine.engine_kwargs.enforce_eager=true",
    ])
    assert data["saves"][0].get("tokens") is None, "the input is not modified"
    config = validate(out)
    assert config.engine.replicas == 2 and config.engine.engine_kwargs == {"max_model_len": 512, "enforce_eager": True}
    assert config.saves[0].tokens == "all" and config.sampling.temperature == 0.5 and config.output.dir == "/tmp/x y"
    swapped = validate(apply_overrides(data, ["saves=null", "intervention=iv.py"]))
    assert swapped.saves is None and swapped.intervention == "iv.py"
    assert validate(apply_overrides(data, ["saves=[{location: model.logits}]"])).saves[0].location == "logits"


@pytest.mark.parametrize("override,needle", [
    ("engine.replicas", "expected key.sub=value"),
    ("=3", "expected key.sub=value"),
    ("saves.7.tokens=all", "saves is a list of 2"),
    ("saves.x.tokens=all", "saves is a list of 2"),
    ("output.dir.sub=1", "output.dir is a value"),
    ("engine.replicas=[unclosed", "not valid YAML"),
])
def test_bad_overrides(tmp_path, override, needle):
    with pytest.raises(BatchConfigError, match="override") as error:
        apply_overrides(minimal(tmp_path), [override])
    assert needle in str(error.value)


def test_config_is_frozen_and_serializable(tmp_path):
    config = validate(minimal(tmp_path))
    with pytest.raises(Exception):
        config.output.shard_size = 3
    assert BatchConfig.model_validate(config.model_dump()) == config


# --------------------------------------------------------------------------- inputs (preflight without vLLM)


def test_missing_prompt_file_fails_before_anything_starts(tmp_path):
    config = validate(minimal(tmp_path, prompts={"path": str(tmp_path / "missing.jsonl")}))
    with pytest.raises(BatchConfigError, match=r"prompts.path .*missing.jsonl.*: no such file"):
        prepare(config, resolve=False)


def test_prompt_formats_and_their_errors(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"key": 3, "text": "x"}\n\n{"key": "b", "text": "y"}\n')
    assert read_prompts(jsonl, "key", "text") == [Prompt("3", "x"), Prompt("b", "y")]
    with pytest.raises(BatchConfigError, match="line 1: no field 'id'"):
        read_prompts(jsonl)
    jsonl.write_text('{"id": 1, "prompt": "x"}\n{"id": 1, "prompt": "y"}\n')
    with pytest.raises(BatchConfigError, match="duplicate id"):
        read_prompts(jsonl)
    jsonl.write_text('{"id": 1, "prompt": "x"}\nnot json\n')
    with pytest.raises(BatchConfigError, match="line 2: not valid JSON"):
        read_prompts(jsonl)
    jsonl.write_text('{"id": 1, "prompt": 5}\n')
    with pytest.raises(BatchConfigError, match="should be a string"):
        read_prompts(jsonl)

    txt = tmp_path / "b.txt"
    txt.write_text("first\n\nthird\n")
    assert read_prompts(txt) == [Prompt("1", "first"), Prompt("3", "third")]
    txt.write_text("\n\n")
    with pytest.raises(BatchConfigError, match="no prompts"):
        read_prompts(txt)

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"uid": [10, 11], "prompt": ["p", "q"]}), parquet)
    assert read_prompts(parquet, "uid") == [Prompt("10", "p"), Prompt("11", "q")]
    with pytest.raises(BatchConfigError, match="no column 'id'"):
        read_prompts(parquet)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def intervention_config(tmp_path: Path, path: Path) -> BatchConfig:
    return validate(minimal(tmp_path, saves=None, intervention=str(path)))


@pytest.mark.parametrize(
    "source,needle",
    [
        ("def intervene(model, tracer)\n    return {}\n", "syntax error at line 1: expected ':'"),
        ("def intervene(model, tracer):\n  x = (\n", "syntax error at line 2"),
        ("def other(model, tracer):\n    return {}\n", "defines no function `intervene(model, tracer)`"),
        ("def intervene(model):\n    return {}\n", "cannot be called as intervene(model, tracer)"),
        ("import no_such_module_here\n", "running the file failed: ModuleNotFoundError"),
    ],
)
def test_bad_intervention_files_fail_before_anything_starts(tmp_path, source, needle):
    config = intervention_config(tmp_path, write(tmp_path, "iv.py", source))
    with pytest.raises(BatchConfigError) as error:
        prepare(config, resolve=False)
    assert "intervention" in str(error.value) and needle in str(error.value)


def test_missing_intervention_file(tmp_path):
    with pytest.raises(BatchConfigError, match="no such file"):
        prepare(intervention_config(tmp_path, tmp_path / "gone.py"), resolve=False)


def test_intervention_is_loaded_unregistered_so_it_ships_by_value(tmp_path):
    import sys

    import cloudpickle

    path = write(tmp_path, "iv.py", "import torch\n\ndef intervene(model, tracer):\n    return {'x': torch.ones(2)}\n")
    fn, digest = load_intervention(path)
    intervene = fn.keywords["intervene"]
    assert intervene.__module__ not in sys.modules and len(digest) == 64
    # Shipped by value: loads in a process that never saw the file.
    assert b"iv.py" in cloudpickle.dumps(intervene) or intervene.__module__.encode() in cloudpickle.dumps(intervene)
    assert fn(None, None)["x"].tolist() == [1.0, 1.0]


# --------------------------------------------------------------------------- save locations


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(2, 2)


class _Tree(torch.nn.Module):
    """The shape of vLLM's Llama: model.{embed_tokens, layers.N, norm}, lm_head."""

    def __init__(self, layers: int = 4):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(4, 2)
        self.model.layers = torch.nn.ModuleList(_Block() for _ in range(layers))
        self.model.norm = torch.nn.LayerNorm(2)
        self.lm_head = torch.nn.Linear(2, 4)


def specs(*locations: str):
    return validate({"model": {"path": "m"}, "prompts": {"path": "p.jsonl"}, "output": {"dir": "o"},
                     "saves": [{"location": loc} for loc in locations]}).saves


def test_save_locations_resolve_in_execution_order():
    reads = resolve_saves(_Tree(), specs("logits", "model.layers.3.output", "model.layers.1.mlp.output",
                                         "model.layers.1.output", "model.layers.1.input", "model.norm.output"))
    assert [r.name for r in reads] == ["model.layers.1.input", "model.layers.1.mlp.output", "model.layers.1.output",
                                       "model.layers.3.output", "model.norm.output", "logits"]
    assert reads[-1] == SaveRead("logits", None, "logits", "last")


@pytest.mark.parametrize("location,needle", [
    ("model.layers.10.output", "'model.layers' has no submodule '10' (its children: 0, 1, 2, 3)"),
    ("model.decoder.output", "'model' has no submodule 'decoder' (its children: embed_tokens, layers, norm)"),
    ("transformer.h.0.output", "the model has no submodule 'transformer' (its children: model, lm_head)"),
    ("model.layers.0.mlp.gate.output", "'model.layers.0.mlp' has no submodule 'gate' (it has no children)"),
])
def test_unknown_module_paths_are_clear(location, needle):
    with pytest.raises(BatchConfigError) as error:
        resolve_saves(_Tree(), specs(location))
    assert f"saves.0.location {location!r}" in str(error.value) and needle in str(error.value)


def test_layer_outputs_are_saved_as_the_residual_stream():
    hidden, residual = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(to_residual((hidden, residual)), hidden + residual)
    assert torch.equal(to_residual(hidden), hidden)
    assert torch.equal(to_residual((hidden, torch.randn(2))), hidden)


def test_nnsight_error_messages_are_unwrapped():
    info = error_info("RuntimeError", "ValueError: seven tokens\n\nIntervention traceback:\n  File x, line 3")
    assert info == {"type": "ValueError", "message": "seven tokens", "traceback": "  File x, line 3"}
    assert error_info("ValueError", "ValueError: boom") == {"type": "ValueError", "message": "boom"}
    wrapped = error_info("RuntimeError", "KeyError: 'k'\n\nIntervention traceback:\n  user line", "  merge line")
    assert wrapped["traceback"] == "  user line" and wrapped["type"] == "KeyError"
    assert error_info("ValueError", "prompt too long")["message"] == "prompt too long"


# --------------------------------------------------------------------------- the run folder


def fingerprint(**extra):
    return {"model": {"path": "m"}, "shard_size": 2, **extra}


def test_a_folder_resumes_only_for_the_same_inputs(tmp_path):
    run = RunDir(tmp_path / "out", fingerprint())
    assert run.check_compatible() is None  # nothing there yet
    run.prepare()
    (run.path / "manifest.json.tmp-host-1-2").write_bytes(b"partial")
    run.write_atomic(run.manifest_path, json.dumps({"fingerprint": fingerprint()}).encode())
    assert run.check_compatible() == {"fingerprint": fingerprint()}
    RunDir(tmp_path / "out", fingerprint()).prepare()
    assert not list(run.path.glob("*.tmp-*")), "stale temporary files are removed"
    with pytest.raises(BatchConfigError, match=r"different inputs \(changed: shard_size\)"):
        RunDir(tmp_path / "out", fingerprint(shard_size=3)).check_compatible()
    run.manifest_path.write_text("{half")
    with pytest.raises(BatchConfigError, match="manifest.json is unreadable"):
        run.check_compatible()


# --------------------------------------------------------------------------- progress, CLI


def test_progress_without_a_terminal_logs_lines():
    stream = io.StringIO()
    progress = Progress(10, initial=2, interval_s=0.0, stream=stream, interactive=False)
    progress.update(3, errors=1)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines and lines[0].startswith("batch: 5/10 prompts (50.0%)") and "prompts/s" in lines[0]
    assert "ETA" in lines[0] and "errors 1" in lines[0]


def test_cli_bad_config_exits_2_before_anything_starts(tmp_path, capsys):
    from nnsight_ray.cli import main

    path = write_config(tmp_path, minimal(tmp_path))
    assert main(["batch", "--config", str(path), "--set", "engine.replica=2"]) == 2
    assert "unknown key 'engine.replica' (did you mean 'engine.replicas'?)" in capsys.readouterr().err
    path = write_config(tmp_path, minimal(tmp_path, prompts={"path": str(tmp_path / "none.txt")}))
    assert main(["batch", "--config", str(path), "--check"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_build_model_delegates(tmp_path, monkeypatch):
    from nnsight_ray import cli

    calls = []
    monkeypatch.setattr("nnsight_ray.models.main", lambda argv: calls.append(argv))
    assert cli.main(["build-model", str(tmp_path / "m"), "--arch", "gpt2"]) == 0
    assert calls == [[str(tmp_path / "m"), "--arch", "gpt2"]]


def test_activation_files_are_safetensors_written_from_pieces(tmp_path):
    from safetensors.torch import load_file

    from nnsight_ray._internal.extract.safetensors_io import write_safetensors

    a = torch.randn(7, 3, dtype=torch.bfloat16)
    ids = torch.arange(7, dtype=torch.int64)
    path = tmp_path / "x.safetensors"
    write_safetensors(str(path), {"h": [a[:2], a[2:2], a[2:]], "ids": [ids]}, {"format": "f"})
    got = load_file(str(path))
    assert torch.equal(got["h"], a) and got["h"].dtype == torch.bfloat16 and torch.equal(got["ids"], ids)

    from nnsight_ray._internal.extract.safetensors_io import safetensors_complete

    assert safetensors_complete(str(path))
    with open(path, "r+b") as handle:  # cut short, as a crash without fsync can leave it
        handle.truncate(path.stat().st_size - 3)
    assert not safetensors_complete(str(path)) and not safetensors_complete(str(tmp_path / "missing"))


def test_run_batch_refuses_an_engine_that_is_not_a_ray_deployment(tmp_path):
    """Ray Data's actors attach to engines by name: a LocalVLLM (in this process) is refused before anything runs."""
    from types import SimpleNamespace

    from nnsight_ray.batch import run_batch

    local = SimpleNamespace(vllm_entrypoint=SimpleNamespace(generate=None))
    prepared = prepare(validate(minimal(tmp_path)), resolve=False)
    with pytest.raises(BatchConfigError, match="LocalVLLM"):
        run_batch(prepared.config, engines=[local], prepared=prepared)
    assert not (tmp_path / "out").exists()
