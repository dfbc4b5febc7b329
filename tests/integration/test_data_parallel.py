"""nnsight_ray.data at TP x PP > 1: a RayVLLM per engine actor, its ranks in the actor's placement group.

On the session's multi-raylet cluster, through Ray Data's own ``build_processor``:

- every save column (layer 1's last token, layer 3's every token, the logits)
  equals the same trace on the in-process ``local_llama``, with the same greedy
  tokens and text, at TP=2 x PP=2 (four ranks, SPREAD over the raylets: tensor
  and pipeline parallelism in one engine, one engine start for both);
- the engine actor and its four rank actors ran in one placement group (the
  actor on one of the ranks' raylets);
- once the dataset is consumed, nothing of the pool is left: its placement
  group is removed, and no engine actor, engine, merge or rank actor is alive;
- an autoscaling pool (``concurrency=(1, 2)``, Ray Data's own actor
  autoscaler): Ray Data starts a second engine actor while the first is busy,
  every row equals the in-process engine's whichever actor ran it, and both
  actors (an engine in each) are gone once the dataset is consumed.
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import ENGINE_KWARGS, assert_close
from test_data import PROMPTS, SAVES, reference, write_prompts

pytestmark = pytest.mark.integration

MAX_TOKENS = 2
PROMPTS = PROMPTS[:3]
LIVE = ("CREATED", "PENDING", "PREPARED", "RESCHEDULING")


@pytest.fixture(scope="module")
def references(local_llama):
    """Each prompt's values on nnsight's in-process engine (shared by both layouts)."""
    return [reference(local_llama, prompt, MAX_TOKENS) for prompt in PROMPTS]


def actors() -> dict[str, dict]:
    """Every actor the GCS knows (alive or dead), by id (the cluster runs no dashboard for ray.util.state)."""
    import ray

    return ray._private.state.actors()


def live_groups() -> set[str]:
    import ray

    return {hex_id for hex_id, group in ray.util.placement_group_table().items() if group["state"] in LIVE}


def ours(before: dict[str, dict]) -> dict[str, list[dict]]:
    """The actors started since ``before``: the pool's engine actors, and its engines' (named ``data-*``)."""
    new = [a for hex_id, a in actors().items() if hex_id not in before]
    return {"workers": [a for a in new if "NNsightEngineStageUDF" in a["ActorClassName"]],
            "engines": [a for a in new if a["Name"].startswith("data-")]}


def test_a_tp2_pp2_engine_equals_local_traces_and_leaves_nothing(ray_cluster, references, model_dir, tmp_path):
    import ray
    from ray.data.llm import build_processor

    from nnsight_ray.batch.sources import local_footer_readers
    from nnsight_ray.data import NNsightEngineProcessorConfig

    layout, strategy = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "SPREAD"
    path = write_prompts(tmp_path / "prompts.parquet", PROMPTS)
    config = NNsightEngineProcessorConfig(
        model_source=model_dir, engine_kwargs={**ENGINE_KWARGS, **layout}, concurrency=1, batch_size=4, saves=SAVES,
        placement_group_config={"bundle_per_worker": {"CPU": 1}, "strategy": strategy})
    columns = [save["location"] for save in SAVES]
    processor = build_processor(
        config,
        preprocess=lambda row: {"prompt": row["text"],
                                "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0}},
        postprocess=lambda row: {name: row[name] for name in
                                 ["id", "generated_text", "generated_tokens", "prompt_token_ids", *columns]},
    )
    groups_before, actors_before, known = live_groups(), actors(), set(ray.util.placement_group_table())
    with local_footer_readers(path):  # one Parquet footer reader, not Ray's 32 actors (docs/data.md)
        rows = {row["id"]: row for row in processor(ray.data.read_parquet(path)).take_all()}

    assert sorted(rows) == [f"q{i}" for i in range(len(PROMPTS))]
    for i, want in enumerate(references):
        row = rows[f"q{i}"]
        assert list(row["prompt_token_ids"]) == want["prompt_token_ids"]
        assert list(row["generated_tokens"]) == want["generated_tokens"]
        assert row["generated_text"] == want["generated_text"]
        for name in columns:
            assert row[name].dtype.name == "float32", (name, row[name].dtype)
            assert_close(torch.from_numpy(row[name].copy()), want[name], rel=1e-4)

    # Placement: one engine actor in one group of four rank bundles; its engine's ranks there.
    made = [g for hex_id, g in ray.util.placement_group_table().items() if hex_id not in known]
    assert [(g["strategy"], len(g["bundles"])) for g in made] == [(strategy, 4)], made
    started = ours(actors_before)
    assert len(started["workers"]) == 1, started["workers"]
    ranks = sorted((a for a in started["engines"] if ".pp" in a["Name"]), key=lambda a: a["Name"])
    assert [a["Name"].split(".", 1)[1] for a in ranks] == ["pp0.tp0", "pp0.tp1", "pp1.tp0", "pp1.tp1"]
    nodes = {a["Address"]["NodeID"] for a in ranks}
    assert len(nodes) >= 2, "SPREAD puts the ranks on more than one raylet"
    assert started["workers"][0]["Address"]["NodeID"] in nodes

    # Nothing left once the dataset is consumed: Ray Data lets the actor go, and it takes down its engine and group.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        started = ours(actors_before)
        alive = [a["Name"] or a["ActorClassName"] for group in started.values() for a in group if a["State"] != "DEAD"]
        leaked = live_groups() - groups_before
        if not alive and not leaked:
            break
        time.sleep(1)
    assert not alive, f"actors of the pool still alive: {alive}"
    assert not leaked, f"placement groups still reserved: {leaked}"
    assert not [n for n in ray.util.list_named_actors(all_namespaces=True) if str(n).find("data-") >= 0]


def test_an_autoscaling_pool_starts_a_second_engine_and_leaves_nothing(ray_cluster, local_llama, model_dir, tmp_path):
    """``concurrency=(1, 2)``: one engine actor to begin with; Ray Data's autoscaler adds one once the first holds
    ``max_tasks_in_flight_per_actor`` blocks (2 here: one batch at a time, so the engine runs in each actor and
    util = 2 / 1 >= Ray Data's 1.75). Every row equals the in-process engine's, and nothing is left."""
    import ray
    import ray.data
    from ray.data.llm import build_processor

    from nnsight_ray.batch.sources import local_footer_readers
    from nnsight_ray.data import NNsightEngineProcessorConfig

    prompts = [f"{word} number {i}" for i, word in enumerate(["Hello", "Ray", "vLLM", "abc"] * 6)]
    path = write_prompts(tmp_path / "prompts.parquet", prompts)
    config = NNsightEngineProcessorConfig(
        model_source=model_dir, engine_kwargs=dict(ENGINE_KWARGS), concurrency=(1, 2), batch_size=2,
        max_concurrent_batches=1, saves=[{"location": "model.layers.1.output", "tokens": "last"}])
    assert not config.rank_actors  # one batch at a time: each actor's engine in the actor
    processor = build_processor(
        config, preprocess=lambda row: {"prompt": row["text"],
                                        "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0}},
        postprocess=lambda row: {"id": row["id"], "text": row["text"], "h1": row["model.layers.1.output"],
                                 "generated_tokens": row["generated_tokens"]})
    actors_before = actors()
    with local_footer_readers(path):
        source = ray.data.read_parquet(path).repartition(target_num_rows_per_block=2, strict=True)
        rows = {row["id"]: row for row in processor(source).take_all()}

    assert sorted(rows) == sorted(f"q{i}" for i in range(len(prompts)))
    for key, row in rows.items():
        want = reference(local_llama, row["text"], MAX_TOKENS)
        assert list(row["generated_tokens"]) == want["generated_tokens"], key
        assert_close(torch.from_numpy(row["h1"].copy()), want["model.layers.1.output"], rel=1e-4)
    started = ours(actors_before)["workers"]
    assert len(started) == 2, f"the pool did not scale to two engine actors: {[a['State'] for a in started]}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(a["State"] != "DEAD" for a in ours(actors_before)["workers"]):
        time.sleep(1)
    assert all(a["State"] == "DEAD" for a in ours(actors_before)["workers"]), "an engine actor of the pool is alive"
