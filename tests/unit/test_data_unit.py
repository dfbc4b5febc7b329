"""nnsight_ray.data without an engine or a cluster: the config, rows in and out, the builder, failure isolation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from nnsight_ray.data import NNsightEngineProcessorConfig, build_processor
from nnsight_ray.data import columns, stage
from nnsight_ray.data.columns import ARRAY, ERROR
from nnsight_ray.errors import RequestError, intervention_error

SAVE = {"location": "model.layers.1.output", "tokens": "last"}


def config(**kwargs):
    kwargs.setdefault("model_source", "/models/tiny")
    if "intervention" not in kwargs:
        kwargs.setdefault("saves", [SAVE])
    return NNsightEngineProcessorConfig(**kwargs)


# --------------------------------------------------------------------------- config


def test_config_takes_ray_data_llm_fields_and_saves():
    made = config(concurrency=(1, 2), batch_size=16, should_continue_on_error=True, engine_kwargs={"dtype": "float32"})
    assert made.columns == ["model.layers.1.output"] and made.saves[0].tokens == "last"
    assert made.get_concurrency() == {"min_size": 1, "max_size": 2}
    assert (made.chat_template_stage, made.tokenize_stage, made.detokenize_stage) == (False, False, False)
    assert made.gpus() == 0.0 and config(accelerator_type="H100").gpus() == 1.0 and config(num_gpus=0.5).gpus() == 0.5


@pytest.mark.parametrize("kwargs, words", [
    ({"saves": None}, "exactly one of `saves`"),
    ({"saves": [SAVE], "intervention": lambda model, tracer: {}}, "exactly one of `saves`"),
    ({"saves": [{"location": "model.layers.1"}]}, "ending in '.output' or '.input'"),
    ({"saves": [SAVE, SAVE]}, "listed twice"),
    ({"saves": [{"location": "logits", "tokens": "first"}]}, "tokens"),
    ({"intervention": lambda model: {}}, "cannot be called as intervene(model, tracer)"),
    ({"intervention": "intervene.txt"}, "should be a .py file"),
    ({"intervention": 3}, "intervention"),
    ({"engine_kwargs": {"tensor_parallel_size": 0}}, "positive integer"),
    ({"engine_kwargs": {"tensor_parallel_size": 2, "placement_group": object()}}, "use placement_group_config"),
    ({"engine_kwargs": {"tensor_parallel_size": 2, "cpus_per_rank": 2}}, "placement_group_config's bundles"),
    ({"engine_kwargs": {"tensor_parallel_size": 2}, "num_cpus": 2}, "num_cpus=2.0"),
    ({"engine_kwargs": {"pipeline_parallel_size": 2}, "placement_group_config": {"bundles": [{"CPU": 1}]}},
     "1 bundles for tensor_parallel_size x pipeline_parallel_size = 2"),
    ({"engine_kwargs": {"tensor_parallel_size": 2}, "placement_group_config": {"strategy": "PACK"}},
     "bundle_per_worker"),
    ({"placement_group_config": {"bundle_per_worker": {"CPU": 1}}, "max_concurrent_batches": 1},
     "for engines of rank actors only"),
    ({"engine_kwargs": {"model": "other"}}, "use model_source"),
    ({"chat_template_stage": True}, "chat_template_stage: not supported"),
    ({"tokenize_stage": {"enabled": True}}, "tokenize_stage: not supported"),
    ({"max_pending_requests": 8}, "max_pending_requests"),
    ({"concurrency": 0}, "positive integer"),
    ({"sves": [SAVE]}, "sves"),
    ({"engine_name": []}, "non-empty list"),
    ({"engine_name": ["a", "a"]}, "['a'] listed twice"),
    ({"engine_name": "a", "engine_kwargs": {"max_model_len": 64}}, "engine_kwargs: a connected engine"),
    ({"engine_name": "a", "num_gpus": 1, "placement_group_config": {"bundle_per_worker": {"CPU": 1}}},
     "num_gpus, placement_group_config: a connected engine"),
])
def test_config_refuses(kwargs, words):
    with pytest.raises(ValidationError) as error:
        config(**kwargs)
    assert words in str(error.value)


def test_config_accepts_a_callable_or_a_file(tmp_path):
    assert config(intervention=lambda model, tracer: {}).columns == []
    assert config(intervention=str(tmp_path / "intervene.py")).intervention.endswith("intervene.py")
    assert config(engine_kwargs={"tensor_parallel_size": 1}).engine_kwargs == {"tensor_parallel_size": 1}


# --------------------------------------------------------------------------- rows in


def test_request_reads_prompt_and_sampling():
    prompt, sampling = columns.request({"prompt": "Hi", "sampling_params": {"max_tokens": np.int64(4),
                                                                            "temperature": 0.0, "top_k": None,
                                                                            "stop": np.array(["x"])}})
    assert prompt == "Hi" and sampling == {"max_tokens": 4, "temperature": 0.0, "stop": ["x"]}
    assert isinstance(sampling["max_tokens"], int)
    prompt, sampling = columns.request({"prompt": "ignored", "tokenized_prompt": np.array([5, 6, 7])})
    assert prompt == [5, 6, 7] and sampling == {}


@pytest.mark.parametrize("row", [{"prompt": ""}, {"prompt": None}, {"tokenized_prompt": []}, {"text": "Hi"},
                                 {"prompt": "Hi", "sampling_params": [1, 2]}])
def test_request_refuses_a_row_without_a_prompt(row):
    with pytest.raises(ValueError):
        columns.request(row)


# --------------------------------------------------------------------------- rows out


def test_saved_values_cross_arrow_in_their_dtype_and_shape():
    """Through Ray Data's own block conversion: a 1-D array in the row's struct, back as the ndarray it was."""
    from ray.data.block import BlockAccessor

    values = {
        "model.layers.1.output": torch.arange(6, dtype=torch.float32),
        "all": torch.arange(12, dtype=torch.float16).reshape(3, 4),
        "bf16": torch.ones(2, 2, dtype=torch.bfloat16),
        "count": 3,
        "top": torch.tensor(7),
    }
    ok = columns.success_row(0, columns.to_columns(values), [1, 2, 3], [4, 5], "ab", "u", 0.5, {"max_tokens": 2})
    bad = columns.failure_row(1, "ValueError: boom", ["model.layers.1.output"], "u")
    assert ok[ERROR] == "" and ok["num_input_tokens"] == 3 and ok["num_generated_tokens"] == 2
    assert bad[ERROR] == "ValueError: boom" and bad["generated_tokens"] == [] and bad["model.layers.1.output"] is None
    block = BlockAccessor.batch_to_block({"__data": [ok, bad]})
    rows = [dict(row["__data"]) for row in BlockAccessor.for_block(block).iter_rows(public_row_format=True)]
    got = columns.restore_arrays(rows[0])
    assert got["model.layers.1.output"].dtype == np.float32 and got["model.layers.1.output"].tolist() == list(range(6))
    assert got["all"].dtype == np.float16 and got["all"].shape == (3, 4)
    np.testing.assert_array_equal(got["all"], np.arange(12, dtype=np.float16).reshape(3, 4))
    assert got["bf16"].dtype == np.float32 and got["bf16"].shape == (2, 2)  # numpy has no bfloat16
    assert got["top"] == 7 and got["top"].dtype == np.int64 and np.ndim(got["top"]) == 0
    assert got["count"] == 3 and got["generated_tokens"] == [4, 5] and got["generated_text"] == "ab"
    failed = columns.restore_arrays(rows[1])
    assert failed["model.layers.1.output"] is None and failed[ERROR] == "ValueError: boom"


def test_host_arrays_are_each_tensors_values_in_its_shape():
    """One host copy per dtype: views of it, each the tensor it stands for (bfloat16 as float32; 0-d, views of a
    larger buffer and non-contiguous tensors included)."""
    base = torch.arange(24, dtype=torch.float32)
    tensors = [base[2:8], base.reshape(4, 6).t(), torch.tensor(5), torch.ones(2, 3, dtype=torch.bfloat16) * 1.5,
               torch.arange(4, dtype=torch.int64), torch.full((3,), 2.0, requires_grad=True) * 1]
    arrays = columns.host_arrays(tensors)
    for tensor, array in zip(tensors, arrays):
        want = tensor.detach().float() if tensor.dtype == torch.bfloat16 else tensor.detach()
        assert array.shape == tuple(tensor.shape) and array.dtype == want.numpy().dtype
        np.testing.assert_array_equal(array, want.numpy())
    assert columns.host_arrays([]) == []


def test_many_columns_fails_only_the_invokes_that_cannot_be_columns():
    """A stage column named, a dtype numpy has no form of: that invoke's error; the batch's others are exact."""
    invokes = [{"h": torch.arange(3, dtype=torch.bfloat16)}, {"generated_text": torch.zeros(1)},
               {"h": torch.zeros(2, dtype=torch.float8_e4m3fn)}, {"h": torch.arange(2.0), "n": 4, "a": np.ones(2)}]
    made = columns.many_columns(invokes)
    assert made[0]["h"]["shape"] == [3] and made[0]["h"]["dtype"] == "float32"
    assert made[0]["h"][columns.ARRAY].tolist() == [0, 1, 2]
    assert isinstance(made[1], ValueError) and "generated_text" in str(made[1])
    assert isinstance(made[2], TypeError) and "no column can hold" in str(made[2])
    assert made[3]["h"][columns.ARRAY].tolist() == [0, 1] and made[3]["n"] == 4
    assert made[3]["a"]["dtype"] == "float64" and made[3]["a"][columns.ARRAY].tolist() == [1, 1]


def test_an_intervention_may_not_overwrite_the_stage_columns():
    with pytest.raises(ValueError, match="generated_text"):
        columns.to_columns({"generated_text": torch.zeros(1)})


def test_describe_error_names_the_interventions_type_and_message():
    typed = intervention_error({"type_name": "ValueError", "message": "ValueError: boom\n\nIntervention traceback:\n"
                                "  File x, line 1"}, "ValueError: boom")
    assert columns.describe_error(typed) == "ValueError: boom"
    assert columns.describe_error(KeyError("model.layers.9")) == "KeyError: 'model.layers.9'"
    assert columns.describe_error(RuntimeError("IndexError: index 12 is out of bounds")) == \
        "IndexError: index 12 is out of bounds"


# --------------------------------------------------------------------------- the builder


def test_ray_data_llm_build_processor_builds_it_through_the_registry():
    from ray.data.llm import build_processor as ray_build_processor

    made = config(concurrency=2, batch_size=8, max_concurrent_batches=2, should_continue_on_error=True)
    processor = ray_build_processor(made, preprocess=lambda row: {"prompt": row["text"]},
                                    builder_kwargs={"check": False})
    assert processor.list_stage_names() == ["NNsightEngineStage"]
    engine = processor.get_stage_by_name("NNsightEngineStage")
    kwargs = engine.get_dataset_map_batches_kwargs(batch_size=8, data_column="__data")
    assert kwargs["batch_size"] == 8 and kwargs["max_concurrency"] == 2
    assert (kwargs["compute"].min_size, kwargs["compute"].max_size) == (1, 2)
    assert kwargs["num_gpus"] == 0 and kwargs["num_cpus"] == 1
    constructor = kwargs["fn_constructor_kwargs"]
    assert constructor["saves"] == [SAVE] and constructor["intervene"] is None
    assert constructor["expected_input_keys"] == ["sampling_params"] and constructor["should_continue_on_error"]
    # The postprocess sees ndarrays (and Ray's wrapper adds the error column).
    row = {"__data": {"h": {ARRAY: [1.0, 2.0], "shape": [2], "dtype": "float16"}}}
    out = processor.postprocess(row)
    assert out["h"].dtype == np.float16 and out[ERROR] == ""


@pytest.mark.parametrize("kwargs, bundles, strategy, placement", [
    ({}, [{"CPU": 1.0}] * 2, "PACK", {"device": "cpu"}),
    ({"accelerator_type": "H100"}, [{"CPU": 1.0, "GPU": 1.0, "accelerator_type:H100": 0.001}] * 2, "PACK",
     {"device": "gpu", "gpus_per_rank": 1.0}),
    ({"placement_group_config": {"bundle_per_worker": {"CPU": 2, "GPU": 1}, "strategy": "STRICT_SPREAD"}},
     [{"CPU": 2.0, "GPU": 1.0}] * 2, "STRICT_SPREAD", {"device": "gpu", "gpus_per_rank": 1.0}),
    ({"placement_group_config": {"bundles": [{"CPU": 1}, {"CPU": 1}, {"CPU": 2}]}},
     [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 2.0}], "PACK", {"device": "cpu"}),
])
def test_a_parallel_engine_places_each_actor_in_a_group_of_its_ranks(kwargs, bundles, strategy, placement):
    """As Ray Data LLM's vLLM stage with the Ray executor: no GPU for the actor, a group per actor from
    ``ray_remote_args_fn``; the ranks' device follows their bundles."""
    from nnsight_ray.data.placement import EngineGroups

    made = config(engine_kwargs={"tensor_parallel_size": 2}, **kwargs)
    assert made.world_size == 2
    engine = build_processor(made, builder_kwargs={"check": False}).get_stage_by_name("NNsightEngineStage")
    got = engine.get_dataset_map_batches_kwargs(batch_size=4, data_column="__data")
    assert got["num_gpus"] == 0 and got["num_cpus"] == 1
    assert got["ray_remote_args_fn"] == EngineGroups(bundles, strategy)
    assert got["fn_constructor_kwargs"]["placement"] == placement
    single = build_processor(config(max_concurrent_batches=1), builder_kwargs={"check": False}) \
        .get_stage_by_name("NNsightEngineStage")
    assert "ray_remote_args_fn" not in single.map_batches_kwargs and single.fn_constructor_kwargs["placement"] is None


def test_a_connected_engine_takes_no_group_and_its_actors_no_gpu():
    """``engine_name``: the actors attach to running deployments (placed already), at any layout or mode."""
    for extra in ({}, {"activations": ACTS, "saves": None}):
        made = config(engine_name="tp2", accelerator_type="H100", **extra)
        assert made.engine_names == ["tp2"] and not made.rank_actors
        engine = build_processor(made, builder_kwargs={"check": False}).get_stage_by_name("NNsightEngineStage")
        got = engine.get_dataset_map_batches_kwargs(batch_size=4, data_column="__data")
        assert got["num_gpus"] == 0 and "ray_remote_args_fn" not in got and "accelerator_type" not in got
        assert got["fn_constructor_kwargs"]["engine_names"] == ["tp2"]
        assert got["fn_constructor_kwargs"]["placement"] is None
    assert config(engine_name=["a", "b"]).engine_names == ["a", "b"]


def test_engines_the_pipeline_starts_export_vllms_metrics_unless_told_not_to():
    """``log_engine_metrics`` (Ray Data LLM's field, default True) turns vLLM's statistics on for the rank-actor
    engines a pipeline starts; a user's ``disable_log_stats``, running engines and an engine in the actor keep
    their own setting."""
    def started(**kwargs):
        made = config(**kwargs)
        engine = build_processor(made, builder_kwargs={"check": False}).get_stage_by_name("NNsightEngineStage")
        return engine.get_dataset_map_batches_kwargs(batch_size=4, data_column="__data")["fn_constructor_kwargs"]

    assert started()["engine_kwargs"].get("disable_log_stats") is False
    assert "disable_log_stats" not in started(log_engine_metrics=False)["engine_kwargs"]
    assert started(engine_kwargs={"disable_log_stats": True})["engine_kwargs"]["disable_log_stats"] is True
    assert "disable_log_stats" not in started(max_concurrent_batches=1)["engine_kwargs"]  # in the actor


def test_an_engine_with_vllms_stats_on_exports_them_through_ray():
    """The engine actor's stat loggers: none where vLLM's stats are off; else the step clock and vLLM's own
    Prometheus logger on Ray's metrics (in place of the process-local one vLLM would add)."""
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    from nnsight_ray._internal.observe.progress import Progress

    assert Progress().stat_loggers() is None
    loggers = Progress(ticking=True).stat_loggers()
    assert loggers[1] is RayPrometheusStatLogger and len(loggers) == 2


def test_batches_go_to_the_connected_engine_with_the_fewest_in_flight():
    udf = FakeUDF(True)
    udf.engines = [stage.Engine(object(), None, None, owned=False) for _ in range(3)]
    udf._lock = __import__("threading").Lock()
    taken = [udf._acquire() for _ in range(4)]
    assert [udf.engines.index(e) for e in taken] == [0, 1, 2, 0]
    taken[1].in_flight -= 1
    assert udf._acquire() is udf.engines[1]


def test_a_connected_engine_must_serve_model_source(tmp_path):
    assert stage.same_model(str(tmp_path), str(tmp_path / "x" / ".."))
    assert not stage.same_model("org/model-a", "org/model-b")
    assert stage.same_model("org/model-a", "org/model-a")


def test_a_group_is_reserved_only_when_ray_data_starts_an_actor():
    """Ray Data also calls ``ray_remote_args_fn`` from its memory issue detector, with no actor to place."""
    import inspect

    from ray.data._internal.execution.operators.actor_pool_map_operator import ActorPoolMapOperator

    from nnsight_ray.data.placement import STARTS_AN_ACTOR, EngineGroups, starting_an_actor

    def _merge_ray_remote_args():  # noqa: N802  (the name Ray Data's actor pool calls it from)
        return starting_an_actor()

    assert _merge_ray_remote_args() and not starting_an_actor()
    assert EngineGroups([{"CPU": 1.0}] * 2)() == {}  # not an actor start: no group, no Ray needed
    # Pinned: Ray Data starts each actor through this method, which calls ray_remote_args_fn.
    assert "self._ray_remote_args_fn()" in inspect.getsource(getattr(ActorPoolMapOperator, STARTS_AN_ACTOR))
    assert f"self.{STARTS_AN_ACTOR}()" in inspect.getsource(ActorPoolMapOperator._start_actor)


def test_build_processor_here_is_the_same_call(tmp_path):
    path = tmp_path / "intervene.py"
    path.write_text("def intervene(model, tracer):\n    return {'h': model.model.layers[0].output[0][-1]}\n")
    processor = build_processor(config(intervention=str(path)), postprocess=lambda row: {"h": row["h"]})
    fn = processor.get_stage_by_name("NNsightEngineStage").fn_constructor_kwargs["intervene"]
    assert fn.keywords["intervene"].__name__ == "intervene"
    with pytest.raises(TypeError, match="NNsightEngineProcessorConfig"):
        build_processor(object())
    with pytest.raises(ValueError, match="postprocess"):
        build_processor(config(intervention=str(path)), builder_kwargs={"postprocess": None})


def test_a_broken_intervention_file_fails_the_build(tmp_path):
    from nnsight_ray.batch.errors import BatchConfigError

    path = tmp_path / "intervene.py"
    path.write_text("def intervene(model):\n    return {}\n")
    with pytest.raises(BatchConfigError, match="cannot be called as intervene"):
        build_processor(config(intervention=str(path)))


# --------------------------------------------------------------------------- failure isolation


class FakeUDF(stage.NNsightEngineStageUDF):
    """The stage's batch logic over a fake trace: prompts containing "bad" raise in their invoke."""

    def __init__(self, continue_on_error: bool) -> None:  # no engine
        self.should_continue_on_error = continue_on_error
        self.names = ["h"]
        from concurrent.futures import ThreadPoolExecutor

        self.engines = [stage.Engine(object(), ThreadPoolExecutor(max_workers=1), None, owned=False)]
        self.traces: list[list[str]] = []


def fake_trace(udf):
    def run(model, fn, requests):
        udf.traces.append([prompt for prompt, _ in requests])
        for prompt, _ in requests:
            if "bad" in prompt:
                raise intervention_error({"type_name": "ValueError", "message": f"bad prompt {prompt}"},
                                         f"ValueError: bad prompt {prompt}")
        return [({"h": torch.full((2,), float(len(p)))}, [1] * len(p), [7], "x") for p, _ in requests]

    return run


def rows(*prompts):
    return [{"__idx_in_batch": i, "prompt": p, "sampling_params": {"max_tokens": 1}} for i, p in enumerate(prompts)]


def test_a_failing_row_is_found_alone_and_the_others_keep_their_values(monkeypatch):
    udf = FakeUDF(continue_on_error=True)
    monkeypatch.setattr(stage, "run_trace", fake_trace(udf))
    out = udf.run_batch(rows("a", "bad one", "ccc", {"not": "a prompt"}))
    assert udf.traces == [["a", "bad one", "ccc"], ["a"], ["bad one"], ["ccc"]]
    by_idx = {row["__idx_in_batch"]: row for row in out}
    assert by_idx[1][ERROR] == "ValueError: bad prompt bad one" and by_idx[1]["h"] is None
    assert by_idx[3][ERROR].startswith("ValueError: the row has no `prompt`")
    assert by_idx[0][ERROR] == by_idx[2][ERROR] == ""
    assert by_idx[2]["h"][ARRAY].tolist() == [3.0, 3.0] and by_idx[2]["prompt_token_ids"] == [1, 1, 1]


def test_one_trace_per_batch_when_nothing_fails(monkeypatch):
    udf = FakeUDF(continue_on_error=False)
    monkeypatch.setattr(stage, "run_trace", fake_trace(udf))
    out = udf.run_batch(rows("a", "bb"))
    assert udf.traces == [["a", "bb"]] and [row[ERROR] for row in out] == ["", ""]


def test_without_continue_on_error_the_batch_fails_with_the_rows_message(monkeypatch):
    udf = FakeUDF(continue_on_error=False)
    monkeypatch.setattr(stage, "run_trace", fake_trace(udf))
    with pytest.raises(RequestError, match=r"^ValueError: bad prompt bad$"):
        udf.run_batch(rows("a", "bad"))
    assert udf.traces == [["a", "bad"]]
    with pytest.raises(RequestError, match="has no `prompt`"):
        udf.run_batch(rows(None))


def test_an_engine_failure_is_fatal_and_a_request_failure_is_not():
    import ray
    from vllm.v1.engine.exceptions import EngineDeadError

    from nnsight_ray.errors import EngineDeadError as OurEngineDead

    assert stage.is_fatal(EngineDeadError()) and stage.is_fatal(OurEngineDead("gone"))
    assert stage.is_fatal(ray.exceptions.ActorDiedError())
    assert not stage.is_fatal(ValueError("boom")) and not stage.is_fatal(RequestError("refused"))


# --------------------------------------------------------------------------- activation datasets

ACTS = {"dir": "/tmp/acts", "locations": ["model.layers.1.output"]}


def test_several_batches_in_flight_need_rank_actors_one_at_a_time_runs_in_the_actor():
    """nnsight's blocking trace on an engine in the actor runs one trace at a time: with several batches in
    flight an actor's engine is a RayVLLM (ranks in its group), whose traces run together."""
    assert config().max_concurrent_batches == 8 and config().rank_actors
    assert config(max_concurrent_batches=2).rank_actors and not config(max_concurrent_batches=1).rank_actors
    assert not config(engine_name="tp1").rank_actors  # a connected engine is placed already
    kwargs = build_processor(config(), builder_kwargs={"check": False}).get_stage_by_name("NNsightEngineStage") \
        .get_dataset_map_batches_kwargs(batch_size=4, data_column="__data")
    assert kwargs["num_gpus"] == 0 and "ray_remote_args_fn" in kwargs
    serial = build_processor(config(max_concurrent_batches=1), builder_kwargs={"check": False}) \
        .get_stage_by_name("NNsightEngineStage").get_dataset_map_batches_kwargs(batch_size=4, data_column="__data")
    assert "ray_remote_args_fn" not in serial


def test_activations_are_a_mode_of_their_own_with_rank_actors_at_any_layout():
    made = config(saves=None, activations=ACTS, placement_group_config={"bundle_per_worker": {"CPU": 2}})
    assert made.activations.dtype == "auto" and not made.activations.generated and made.rank_actors
    assert made.world_size == 1 and made.rank_bundles() == ([{"CPU": 2.0}], "PACK")
    assert not config(max_concurrent_batches=1).rank_actors
    assert config(saves=None, activations={**ACTS, "dir": "rel/acts"}).activations.dir.endswith("/rel/acts")
    engine = build_processor(config(saves=None, activations=ACTS), builder_kwargs={"check": False}) \
        .get_stage_by_name("NNsightEngineStage")
    kwargs = engine.get_dataset_map_batches_kwargs(batch_size=4, data_column="__data")
    assert kwargs["num_gpus"] == 0 and "ray_remote_args_fn" in kwargs  # the ranks sit in the actor's group
    constructor = kwargs["fn_constructor_kwargs"]
    assert constructor["placement"] == {"device": "cpu"} and constructor["saves"] is None
    assert constructor["activations"]["locations"] == ["model.layers.1.output"]
    assert constructor["max_concurrent_batches"] == 8


@pytest.mark.parametrize("kwargs, words", [
    ({"activations": ACTS}, "exactly one of `saves`"),  # and saves
    ({"saves": None, "activations": {**ACTS, "locations": ["logits"]}}, "is not '<module>.output'"),
    ({"saves": None, "activations": {**ACTS, "locations": ["model.layers.1.input"]}}, "is not '<module>.output'"),
    ({"saves": None, "activations": {**ACTS, "locations": ["a.output", "a.output"]}}, "listed twice"),
    ({"saves": None, "activations": {**ACTS, "dir": "s3://bucket/acts"}}, "the ranks write local files"),
    ({"saves": None, "activations": {**ACTS, "dtype": "int8"}}, "dtype"),
    ({"saves": None, "activations": {**ACTS, "extra": 1}}, "extra"),
])
def test_activations_refuse(kwargs, words):
    with pytest.raises(ValidationError) as error:
        config(**kwargs)
    assert words in str(error.value)


def test_a_part_names_its_files_and_each_prompts_rows():
    from nnsight_ray.data.stage import part_rows

    stages = [{"file": "/d/p.stage0.safetensors", "prompts": {0: 5, 1: 3}},
              {"file": "/d/p.stage1.safetensors", "prompts": {0: 5, 1: 3}}]
    assert part_rows(stages, [0, 1]) == (["p.stage0.safetensors", "p.stage1.safetensors"], [5, 3])
    assert part_rows([{"file": "/d/p.safetensors", "prompts": {0: 5}}, {"file": None, "prompts": {}}], [0, 1])[1] \
        == [None, None]
    assert part_rows([], [0]) == ([], [None])


class FakeEntrypoint:
    """``RayVLLM.vllm_entrypoint``'s extraction calls: prompts containing "long" are refused, as vLLM refuses them."""

    def __init__(self):
        self.parts, self.discarded, self.committed = [], [], []

    def prompts(self, part):
        (prompts,) = [p for name, p, *_ in self.parts if name == part]
        return prompts

    def extract_async(self, prompts, part, directory, locations, indices, dtype, max_tokens, temperature, generated):
        self.parts.append((part, list(prompts), directory, dtype, max_tokens, temperature, generated))
        return part

    def wait(self, part):
        from types import SimpleNamespace

        for prompt in self.prompts(part):
            if "long" in str(prompt):
                raise RequestError("VLLMValidationError: longer than the maximum context length")
        return [SimpleNamespace(prompt_token_ids=[1] * len(p), outputs=[SimpleNamespace(token_ids=[9])])
                for p in self.prompts(part)]

    def extract_commit(self, part, fsync=False):
        self.committed.append(part)
        counts = {i: len(p) for i, p in enumerate(self.prompts(part))}
        return [{"file": f"/tmp/acts/{part}.safetensors", "prompts": counts}, None]

    def extract_discard(self, part):
        self.discarded.append(part)


class FakeRayVLLM:
    def __init__(self):
        self.vllm_entrypoint = FakeEntrypoint()
        self.tokenizer = None


class FakeActivationUDF(stage.NNsightEngineStageUDF):
    def __init__(self, continue_on_error: bool = True) -> None:  # no engine
        from concurrent.futures import ThreadPoolExecutor

        self.should_continue_on_error = continue_on_error
        self.activations = {**ACTS, "dtype": "auto", "generated": False, "fsync": False}
        self.names = list(columns.ACTIVATION_COLUMNS)
        self.engines = [stage.Engine(FakeRayVLLM(), ThreadPoolExecutor(max_workers=1), None, owned=False)]


@pytest.fixture
def fake_commits(monkeypatch):
    from nnsight_ray.data import stage

    monkeypatch.setattr(stage, "collect_commits", lambda commits, part: [c for c in commits if c is not None])


def test_an_activation_batch_is_one_part_and_each_row_names_its_files(fake_commits):
    udf = FakeActivationUDF()
    out = udf.extract_batch(rows("ab", "cdef", "g"))
    entry = udf.model.vllm_entrypoint
    ((part, prompts, directory, dtype, max_tokens, temperature, generated),) = entry.parts
    assert part.startswith("part-") and prompts == ["ab", "cdef", "g"] and directory == "/tmp/acts"
    assert (dtype, max_tokens, temperature, generated) == (None, 1, 0.0, False) and entry.committed == [part]
    by_idx = {row["__idx_in_batch"]: row for row in out}
    assert [by_idx[i]["activation_index"] for i in range(3)] == [0, 1, 2]
    assert [by_idx[i]["activation_rows"] for i in range(3)] == [2, 4, 1]
    assert all(row["activation_files"] == [f"{part}.safetensors"] and row[ERROR] == "" for row in out)
    assert by_idx[1]["prompt_token_ids"] == [1, 1, 1, 1] and by_idx[1]["generated_tokens"] == [9]
    udf.extract_batch(rows("again"))
    assert len({name for name, *_ in entry.parts}) == 2, "every batch a part name of its own"


def test_a_refused_prompt_fails_its_row_alone_and_its_part_is_discarded(fake_commits):
    udf = FakeActivationUDF()
    batch = rows("ab", "too long", "g", {"not": "a prompt"})
    batch[2]["sampling_params"] = {"max_tokens": 1, "top_p": 0.5}
    out = udf.extract_batch(batch)
    entry = udf.model.vllm_entrypoint
    assert [prompts for _, prompts, *_ in entry.parts] == [["ab", "too long"], ["ab"], ["too long"]]
    assert entry.discarded == [entry.parts[0][0], entry.parts[2][0]] and entry.committed == [entry.parts[1][0]]
    by_idx = {row["__idx_in_batch"]: row for row in out}
    assert by_idx[0][ERROR] == "" and by_idx[0]["activation_files"] == [f"{entry.parts[1][0]}.safetensors"]
    assert by_idx[1][ERROR].startswith("VLLMValidationError: longer than") and by_idx[1]["activation_files"] is None
    assert by_idx[2][ERROR].startswith("ValueError: sampling_params ['top_p']")
    assert by_idx[3][ERROR].startswith("ValueError: the row has no `prompt`")
    with pytest.raises(RequestError, match="longer than"):
        FakeActivationUDF(continue_on_error=False).extract_batch(rows("too long"))


def test_an_engine_that_died_under_an_activation_batch_ends_the_actor(fake_commits, monkeypatch):
    from nnsight_ray.errors import EngineDeadError

    udf = FakeActivationUDF()
    monkeypatch.setattr(udf.model.vllm_entrypoint, "wait", lambda ref: (_ for _ in ()).throw(EngineDeadError("gone")))
    monkeypatch.setattr(stage.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit):
        udf.extract_batch(rows("ab", "cd"))
    assert len(udf.model.vllm_entrypoint.parts) == 1, "not retried on the dead engine"


def test_a_ray_engines_trace_is_sent_on_its_thread_and_waited_for_off_it(monkeypatch):
    """A RayVLLM's batch holds its tracing thread only while the trace is built and sent (``blocking=False``), so
    the actor's next batch can be sent while this one runs; an in-process engine's holds it to the end."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    class RayVLLM:  # the name is what marks an engine whose traces can be sent without waiting
        pass

    seen = []

    class Sent:
        def collect(self):
            seen.append(("collect", threading.current_thread().name))
            # trace(outputs=True): the values, and each request's output read at its end (no block waits for it)
            return {"rows": [{"h": torch.ones(2)}]}, [{"prompt_token_ids": [1, 2], "token_ids": [7], "text": "x"}]

    def run(model, fn, requests, blocking=True):
        seen.append(("build", threading.current_thread().name, blocking))
        return Sent() if not blocking else [({"h": torch.ones(2)}, [1, 2], [7], "x")]

    monkeypatch.setattr(stage, "run_trace", run)
    udf = FakeUDF(True)
    udf.engines = [stage.Engine(RayVLLM(), ThreadPoolExecutor(1, thread_name_prefix="tracing"), None, owned=False)]
    out = udf.run_batch(rows("ab"))
    assert out[0]["generated_tokens"] == [7] and out[0]["__inference_error__"] == ""
    assert seen[0][0] == "build" and seen[0][1].startswith("tracing") and seen[0][2] is False
    assert seen[1][0] == "collect" and not seen[1][1].startswith("tracing")
    seen.clear()
    udf.engines = [stage.Engine(object(), ThreadPoolExecutor(1, thread_name_prefix="tracing"), None, owned=False)]
    udf.run_batch(rows("ab"))
    assert [entry[0] for entry in seen] == ["build"] and seen[0][2] is True


def test_trace_rows_pairs_each_requests_values_with_its_output_in_every_form():
    """nnsight's collection lists a name saved by several requests in request order, and gives one request's
    alone; a trace with n > 1 keeps slots. Each form pairs values i with output i."""

    class Collected:
        def __init__(self, saves, outputs):
            self.collect = lambda: (saves, outputs)

    outs = [{"prompt_token_ids": [i], "token_ids": [i + 10], "text": f"t{i}"} for i in range(3)]
    many = stage.trace_rows(Collected({"values": [{"h": 0}, {"h": 1}, {"h": 2}]}, outs))
    assert many == [({"h": i}, [i], [i + 10], f"t{i}") for i in range(3)]
    assert stage.trace_rows(Collected({"values": {"h": 0}}, outs[:1])) == [({"h": 0}, [0], [10], "t0")]
    assert stage.trace_rows(Collected({"rows": [{"h": 5}, {"h": 6}]}, outs[:2]))[1] == ({"h": 6}, [1], [11], "t1")
