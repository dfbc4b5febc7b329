"""Every multi-rank layout against the single-device engine: Ray rank actors, placement, pipeline traces.

Each case runs the same trace on a multi-rank engine and on the single-device
reference (``local_llama``, nnsight's in-process engine) and compares: values
within 1e-3 relative, the same greedy tokens.

Layouts, one at a time (a parametrized module fixture: pytest groups the tests
by layout and shuts each engine down before the next starts):

- ``tp2``: the session's TP=2 RayVLLM, ranks on two raylets (STRICT_SPREAD), with ``taps``;
- ``pp2``: RayVLLM, PP=2 on two raylets (STRICT_SPREAD), ``enforce_eager=False``;
- ``tp2pp2``: RayVLLM, TP=2 x PP=2 (SPREAD), with ``taps`` (at PP > 1 a block's step runs eagerly);
- ``pp3``: ``LocalVLLM(distributed_executor_backend="ray")``, PP=3, whose middle
  stage both receives recordings and sends them on (layers 0 | 1-2 | 3), with nnsight's ``taps``, one of
  them inside a whole layer's forward (``LAYER_SOURCE_TAP``: every stage opens layer 0's forward at load).

The tiny Llama has 4 layers, so at ``pipeline_parallel_size=2`` layers 0-1 (and
the embedding) run on stage 0 and layers 2-3, the final norm and the logits on
stage 1. Rank identities, registered blocks and values run on the layouts with
more than one rank of RayVLLM; the pipeline traces on every pipelined layout; ``tracer.cache()`` on the
pipelined RayVLLM layouts.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import cloudpickle
import nnsight
import pytest
import ray
import torch

from conftest import ENGINE_KWARGS, TAPS, assert_close, ray_engine, request_counts

pytestmark = pytest.mark.integration

# Blocks below call this module's helpers (``residual``, the edits); ship them
# by value, since the engine's workers cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPT = "Hello world"
PROMPTS = ["Hello world", "The quick brown fox", "abc"]
N_LAYERS = 4
# An operation in a decoder layer's own forward (its MLP call), a tap on pp3.
LAYER_SOURCE_TAP = "model.layers.0.source.self_mlp_0.output"

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2, placement_strategy="STRICT_SPREAD"),  # the session's: taps (conftest)
    # A graph engine (issue 23): on the CPU build no graph is captured, so every step is eager, and every
    # location, tapped or not, is served as on an eager engine; these tests check the mode's plumbing.
    "pp2": dict(pipeline_parallel_size=2, placement_strategy="STRICT_SPREAD", enforce_eager=False),
    # taps at TP x PP (issue 23: taps at any layout): a block's step runs eagerly there (graphs.served_taps).
    "tp2pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, placement_strategy="SPREAD",
                   taps=TAPS),
    # LocalVLLM's taps go through nnsight's own route: each stage's runner opens the forward a sourced tap names,
    # layer 0's on the stages that run other layers too (vLLM's placeholder there: pipeline.lend_forwards).
    "pp3": dict(pipeline_parallel_size=3, placement_strategy="SPREAD", taps=["model.layers.*.output", LAYER_SOURCE_TAP]),
}
# The layouts each group of tests runs on (by value: pytest sets each engine up once).
ray_layouts = pytest.mark.parametrize("engine", ["tp2", "pp2", "tp2pp2"], indirect=True, scope="module")
# pp3 is LocalVLLM on Ray ranks: the same topology() as RayVLLM.
topologies = pytest.mark.parametrize("engine", ["tp2", "pp2", "tp2pp2", "pp3"], indirect=True, scope="module")
pipelines = pytest.mark.parametrize("engine", ["pp2", "tp2pp2", "pp3"], indirect=True, scope="module")


@pytest.fixture(scope="module")
def engine(request, ray_cluster, model_dir):
    """``(name, model)`` of one layout; TP=2 is the session's engine (the batch tests use it too)."""
    name = request.param
    if name == "tp2":
        yield name, request.getfixturevalue("ray_tp2")
        return
    groups_before = live_placement_groups()
    shm_before = cpu_shm_segments()
    if name == "pp3":
        from nnsight_ray import LocalVLLM

        model = LocalVLLM(model_dir, dispatch=True, distributed_executor_backend="ray", **LAYOUTS[name],
                          **ENGINE_KWARGS)
    else:
        model = ray_engine(request, model_dir, name, **LAYOUTS[name])
    # vLLM's CPU communicator leaves one /dev/shm segment per rank and group;
    # the ranks unlink theirs once every member has joined (cpu_worker.py)
    assert cpu_shm_segments() <= shm_before
    yield name, model
    model.shutdown()
    # the ranks' placement group was reserved by us; shutdown hands it back
    assert live_placement_groups() <= groups_before


@pytest.fixture
def pp(engine):
    return engine[1]


def cpu_shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "-cpushm_" in name}


def live_placement_groups() -> set[str]:
    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


@pytest.fixture
def ref(local_llama):
    return local_llama


@pytest.fixture(autouse=True)
def no_requests_left_behind(request):
    yield
    for name in ("pp", "local_llama", "ray_tp1"):
        if name in request.fixturenames:
            # `pp` is torn down by now; its engine (the module's) is not
            model = request.getfixturevalue("engine")[1] if name == "pp" else request.getfixturevalue(name)
            counts = request_counts(model)
            assert counts and all(count == 0 for count in counts), f"{name}: requests left tracked: {counts}"


def residual(model, i: int) -> torch.Tensor:
    """Layer ``i``'s residual stream (vLLM's Llama layer returns ``(hidden, residual)``)."""
    out = model.model.layers[i].output
    return (out[0] + out[1]).clone()


# --- 0. rank actors: placement, identities, values against one device --------


def residual_trace(model, prompt: str, max_tokens: int = 3) -> dict:
    """Prefill residual stream of every layer, the first logits, the greedy tokens."""
    with model.trace(prompt, temperature=0.0, max_tokens=max_tokens) as tracer:
        layers = nnsight.save([
            (model.model.layers[i].output[0] + model.model.layers[i].output[1]).clone()
            for i in range(N_LAYERS)
        ])
        logits = model.logits.clone().save()
        result = tracer.result.save()
    return {"layers": layers, "logits": logits, "tokens": list(result.outputs[0].token_ids)}


@pytest.fixture(scope="module")
def reference(local_llama):
    return {p: residual_trace(local_llama, p) for p in PROMPTS}


def check_against(reference, model) -> None:
    for prompt in PROMPTS:
        got, want = residual_trace(model, prompt), reference[prompt]
        assert got["tokens"] == want["tokens"]
        assert_close(got["logits"], want["logits"])
        for layer in range(N_LAYERS):
            assert_close(got["layers"][layer], want["layers"][layer])
    assert request_counts(model) == [0] * len(request_counts(model))


def test_local_vllm_reference_is_self_consistent(reference):
    want = reference[PROMPTS[0]]
    assert int(want["logits"].argmax(-1)[-1]) == want["tokens"][0]


def test_single_rank_ray_engine_matches_local(ray_tp1, reference):
    check_against(reference, ray_tp1)


@topologies
def test_topology_names_ranks_and_spreads_nodes(engine):
    name, model = engine
    tp, pp = LAYOUTS[name].get("tensor_parallel_size", 1), LAYOUTS[name].get("pipeline_parallel_size", 1)
    topology = model.topology()
    assert [(t["pp_rank"], t["tp_rank"]) for t in topology] == [(p, t) for p in range(pp) for t in range(tp)]
    # LocalVLLM's ranks are named after vLLM's engine instance, RayVLLM's after the deployment
    prefix = name if name != "pp3" else topology[0]["actor_name"].rsplit(".pp", 1)[0]
    assert [t["actor_name"] for t in topology] == [f"{prefix}.pp{p}.tp{t}" for p in range(pp) for t in range(tp)]
    nodes = [t["node_id"] for t in topology]
    if LAYOUTS[name]["placement_strategy"] == "STRICT_SPREAD":
        assert len(set(nodes)) == len(nodes), "STRICT_SPREAD put two ranks on one node"
    else:
        assert len(set(nodes)) >= 2
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(nodes) <= alive


def _early_rank_ids(model) -> list[str]:
    """The actor ids of the rank actors ``model``'s engine actor created itself (``early_ranks``)."""
    return ray.get(model.vllm_entrypoint.engine.__ray_call__.remote(
        lambda actor: [rank._actor_id.hex() for rank in actor.early_ranks]))


def test_ranks_started_early_are_the_ones_vllm_runs(ray_tp2, ray_tp1):
    """``early_ranks`` (the default; the session's TP=2 engine): the engine actor starts both rank actors
    before vLLM's engine core, and the executor adopts them (``NNsightRankProc.adopt``); one it could not
    adopt would be killed and replaced by one of the same name. So the ranks vLLM runs are exactly the
    actors the engine actor created, all alive. ``tp1`` (``early_ranks=False``) has none of its own: its
    rank is the executor's. Every other test on ``tp2`` runs on adopted ranks."""
    import ray._private.state as ray_state

    names = {t["actor_name"] for t in ray_tp2.topology()}
    assert names == {"tp2.pp0.tp0", "tp2.pp0.tp1"}
    running = {a["ActorID"]: a["State"] for a in ray_state.actors().values() if a.get("Name") in names
               and a["State"] != "DEAD"}
    dead = [a["Name"] for a in ray_state.actors().values() if a.get("Name") in names and a["State"] == "DEAD"]
    assert not dead, f"an early rank was replaced: {dead}"
    assert sorted(_early_rank_ids(ray_tp2)) == sorted(running), running
    assert set(running.values()) == {"ALIVE"}
    assert _early_rank_ids(ray_tp1) == []


@ray_layouts
def test_layout_matches_single_device(engine, reference):
    check_against(reference, engine[1])


@ray_layouts
def test_extraction_files_equal_single_device(engine, reference, tmp_path):
    """Rank-written activations (issue 24): every prompt token of every layer, one file per stage, rows aligned."""
    from safetensors.numpy import load_file

    name, model = engine
    pp = LAYOUTS[name].get("pipeline_parallel_size", 1)
    locations = [f"model.layers.{i}.output" for i in range(N_LAYERS)]
    ray.get(model.vllm_entrypoint.extract_async(PROMPTS, "part-x", str(tmp_path), locations, indices=[7, 3, 5]))
    written = [w for w in ray.get(model.vllm_entrypoint.extract_commit("part-x")) if w is not None]
    assert len(written) == pp, f"one writer per stage: {written}"
    files = sorted(tmp_path.glob("part-x*.safetensors"))
    assert [f.name for f in files] == ([f"part-x.stage{s}.safetensors" for s in range(pp)] if pp > 1
                                       else ["part-x.safetensors"])
    stages = [load_file(str(f)) for f in files]
    for stage in stages[1:]:  # every stage's rows are the same tokens in the same order
        for key in ("token_ids", "prompt_index", "position"):
            assert (stage[key] == stages[0][key]).all()
    data = {k: v for stage in stages for k, v in stage.items()}
    assert sorted(k for k in data if k.startswith("model.")) == locations
    assert list(dict.fromkeys(data["prompt_index"].tolist())) == [3, 5, 7], "rows sorted by prompt index"
    for index, prompt in zip([7, 3, 5], PROMPTS):
        rows = data["prompt_index"] == index
        assert (data["position"][rows] == range(int(rows.sum()))).all()
        for layer, location in enumerate(locations):
            assert_close(torch.from_numpy(data[location][rows]), reference[prompt]["layers"][layer])
    # nothing is kept for a committed part, and a second commit writes an empty one
    again = [w for w in ray.get(model.vllm_entrypoint.extract_commit("part-x")) if w is not None]
    assert all(w["rows"] == 0 and w["file"] is None for w in again)
    # and every rank says so: no part held, nothing being written, no host buffer of rows left mapped
    # (the gauge python -m benchmarks.gpu prints)
    held = model.vllm_entrypoint.collective_rpc("nnsight_ray_extract_memory")
    assert len(held) == pp * LAYOUTS[name].get("tensor_parallel_size", 1), held
    assert all(h["parts"] == 0 and h["writing"] == 0 and h["host_mb"] == 0 for h in held), held
    # the same files whichever way rows wait on the host: "ring" computes them straight into buffers
    # mapped for them, unmapped once written (``host_memory``), switched on every rank while idle
    ranks = len(held)
    rpc = model.vllm_entrypoint.collective_rpc
    assert rpc("nnsight_ray_extract_staging", args=("ring",)) == ["ring"] * ranks
    try:
        ray.get(model.vllm_entrypoint.extract_async(PROMPTS, "part-r", str(tmp_path), locations, indices=[7, 3, 5]))
        ray.get(model.vllm_entrypoint.extract_commit("part-r"))
        ringed = sorted(tmp_path.glob("part-r*.safetensors"))
        assert len(ringed) == len(files)
        for before, after in zip(stages, (load_file(str(f)) for f in ringed)):
            assert sorted(before) == sorted(after)
            assert all((before[k] == after[k]).all() for k in before)
        assert all(h["host_mb"] == 0 and h["parts"] == 0 for h in rpc("nnsight_ray_extract_memory"))
    finally:
        assert rpc("nnsight_ray_extract_staging", args=("pool",)) == ["pool"] * ranks  # the default


@ray_layouts
def test_extraction_of_generated_tokens_equals_a_prefill_of_the_whole_sequence(engine, local_llama, tmp_path):
    """``generated=True``: each decode step's row too, at its position, with the token the step ran,
    equal to one prefill of prompt + generated tokens on the single-device engine; stages' rows aligned."""
    from safetensors.numpy import load_file

    name, model = engine
    locations = [f"model.layers.{i}.output" for i in range(N_LAYERS)]
    outputs = ray.get(model.vllm_entrypoint.extract_async(PROMPTS, "part-g", str(tmp_path), locations, max_tokens=4,
                                                          generated=True, ignore_eos=True))
    written = [w for w in ray.get(model.vllm_entrypoint.extract_commit("part-g")) if w is not None]
    stages = [load_file(str(f)) for f in sorted(tmp_path.glob("part-g*.safetensors"))]
    assert len(stages) == len(written) == LAYOUTS[name].get("pipeline_parallel_size", 1)
    for stage in stages[1:]:
        for key in ("token_ids", "prompt_index", "position"):
            assert (stage[key] == stages[0][key]).all()
    data = {k: v for stage in stages for k, v in stage.items()}
    for index, output in enumerate(outputs):
        generated = list(output.outputs[0].token_ids)
        assert len(generated) == 4
        sequence = list(output.prompt_token_ids) + generated[:-1]  # the last token is sampled, never run
        rows = data["prompt_index"] == index
        assert data["token_ids"][rows].tolist() == sequence
        assert data["position"][rows].tolist() == list(range(len(sequence)))
        assert written[0]["prompts"][index] == len(sequence)
        want = residual_trace(local_llama, {"prompt_token_ids": sequence}, max_tokens=1)
        for layer, location in enumerate(locations):
            assert_close(torch.from_numpy(data[location][rows]), want["layers"][layer])
    held = model.vllm_entrypoint.collective_rpc("nnsight_ray_extract_memory")
    assert all(h["parts"] == 0 and h["writing"] == 0 and h["host_mb"] == 0 for h in held), held
    # a location the model does not have is refused before any prompt is sent, naming what is there
    from nnsight_ray.errors import RequestError

    with pytest.raises(RequestError, match="'model.layers' has no submodule '9'"):
        model.vllm_entrypoint.extract_async(PROMPTS, "part-bad", str(tmp_path), ["model.layers.9.output"])


@ray_layouts
def test_registered_block_reads_first_and_last_stage(engine, local_llama):
    _, model = engine
    prompts = ["Hello", "World!"]
    with model.edit() as (tracer, edit):
        first = model.model.layers[0].output[0].clone().save()
        last = model.model.layers[3].output[0].clone().save()
    try:
        outputs = model.generate(prompts, max_tokens=2, temperature=0.0)
    finally:
        edit.clear()
    for prompt, output in zip(prompts, outputs):
        with local_llama.trace(prompt, temperature=0.0, max_tokens=1):
            want_first = local_llama.model.layers[0].output[0].clone().save()
            want_last = local_llama.model.layers[3].output[0].clone().save()
        assert_close(output.saves["first"], want_first)
        assert_close(output.saves["last"], want_last)
    after = model.generate(prompts, max_tokens=1, temperature=0.0)
    assert all(not o.saves for o in after)
    counts = request_counts(model)
    assert counts == [0] * len(counts)


@pytest.mark.parametrize("engine", ["tp2", "pp2", "tp2pp2"], indirect=True, scope="module")
def test_graph_modes_count_every_step_on_every_rank(engine):
    """Graph engines (tp2 and tp2pp2: taps, pp2: enforce_eager=False) report how steps ran: on the CPU build,
    all eagerly.

    (Placed before the kill tests, which shut pp2 down.)
    """
    name, model = engine
    with model.trace(PROMPT, max_tokens=3, temperature=0.0):
        model.model.layers[0].mlp.output.save()  # untapped on tp2: served, as the other tests here show
    modes = model.step_modes()
    assert len(modes) == len(model.topology()), modes
    assert all(set(rank) == {"eager"} and rank["eager"] >= 3 for rank in modes), modes
    assert model.resolved_config()["config"]["model_config.enforce_eager"] == "False"


@pytest.mark.parametrize("engine", ["tp2", "tp2pp2", "pp3"], indirect=True, scope="module")
def test_a_tap_inside_a_modules_forward_is_served_at_prefill_and_decode(engine, ref):
    """``taps`` naming an operation in a forward (``.source.``; tp2 and tp2pp2, RayVLLM): the ranks open that forward at load, and a trace reads the operation at the prefill and the
    next step as the single-device engine does (on the CPU build every step is eager). At PP > 1 (tp2pp2, and
    pp3, LocalVLLM, with a tap inside a whole layer) the stages that do not hold layer 0 show its forward's
    operations through their stand-in (``ownership.forward_templates``), and those that do not run a layer show a layer's own operations on vLLM's placeholder
    (``ownership.lend_forwards``: a layer's, or the final norm's as the last stage offers it at load), so LocalVLLM with ``LAYER_SOURCE_TAP`` starts at PP > 1 and
    ``layers[0].source`` and ``norm.source`` read on every stage."""
    name, model = engine

    def run(m):
        with m.trace(PROMPT, max_tokens=3, temperature=0.0) as tracer:
            out = nnsight.save([])
            # opened before the first forward runs (a forward opened while it runs shows its operations from
            # the next call on: nnsight's rule, in-process too)
            first, last = m.model.layers[0].source, m.model.layers[N_LAYERS - 1].source
            norm = m.model.norm.source  # the final norm, outside any list: on the last stage only
            for _ in tracer.iter[0:2]:
                out.append(m.model.layers[0].self_attn.source.self_o_proj_0.output[0].clone())
                out.append(first.self_mlp_0.output.clone())
                out.append(last.self_mlp_0.output.clone())
                out.append(norm.self__forward_method_0.output[0].clone())
        return out

    got, want = run(model), run(ref)
    assert len(got) == len(want) == 8
    for mine, theirs in zip(got, want):
        assert_close(mine, theirs)


def test_a_tap_on_an_operation_the_forward_lacks_is_refused_with_its_operations(ray_cluster, model_dir):
    from nnsight_ray import RayVLLM

    groups_before = live_placement_groups()
    with pytest.raises(ValueError, match=r"no operation 'nope_0'.*self_o_proj_0"):
        RayVLLM(model_dir, name="bad-tap", taps=["model.layers.0.self_attn.source.nope_0.output"],
                **ENGINE_KWARGS)
    # the engine launched beside the meta build is taken down
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("bad-tap.")]
    assert live_placement_groups() <= groups_before


def test_unsatisfiable_placement_fails_fast_with_what_was_asked(ray_cluster, model_dir):
    import time

    from nnsight_ray import RayVLLM
    from nnsight_ray.errors import PlacementError

    groups_before = live_placement_groups()
    started = time.monotonic()
    with pytest.raises(PlacementError) as info:
        RayVLLM(model_dir, name="too-big", tensor_parallel_size=2, cpus_per_rank=64,
                placement_timeout_s=3, **ENGINE_KWARGS)
    # reserved before any actor starts: the timeout plus a little, not an engine start
    assert time.monotonic() - started < 15
    message = str(info.value)
    assert "'CPU': 64" in message and "STRICT" not in message or "PACK" in message
    assert "Cluster total" in message
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("too-big.")]
    assert live_placement_groups() <= groups_before

    # start_many: the same error, and nothing of the batch is left running
    with pytest.raises(PlacementError, match="Cluster total"):
        RayVLLM.start_many(model_dir, {"too-big": {"cpus_per_rank": 64, "placement_timeout_s": 3},
                                       "never": {}}, **ENGINE_KWARGS)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(("too-big.", "never."))]
    assert live_placement_groups() <= groups_before


# --- 1. reads on every stage -------------------------------------------------


def read_everything(model, prompt: str = PROMPT) -> dict:
    with model.trace(prompt, temperature=0.0, max_tokens=3) as tracer:
        embed = model.model.embed_tokens.output.clone().save()
        layers = nnsight.save([residual(model, i) for i in range(N_LAYERS)])
        norm = model.model.norm.output[0].clone().save()
        logits = model.logits.clone().save()
        samples = model.samples.clone().save()
        result = tracer.result.save()
    return {
        "layers": layers,
        "embed": embed,
        "norm": norm,
        "logits": logits,
        "samples": samples,
        "tokens": list(result.outputs[0].token_ids),
    }


@pipelines
def test_reads_on_every_stage(pp, ref):
    got, want = read_everything(pp), read_everything(ref)
    assert got["tokens"] == want["tokens"]
    for i in range(N_LAYERS):
        assert_close(got["layers"][i], want["layers"][i])
    for name in ("embed", "norm", "logits"):
        assert not isinstance(got[name], nnsight_ghost_type()), f"{name} came back as a placeholder"
        assert_close(got[name], want[name])
    assert torch.equal(got["samples"], want["samples"])


def nnsight_ghost_type() -> type:
    from nnsight_ray._internal.pipeline import Ghost

    return Ghost


@pipelines
def test_several_prompts_in_one_trace(pp, ref):
    def run(model):
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke("Hi there"):
                a0 = residual(model, 0).save()
                a3 = residual(model, 3).save()
            with tracer.invoke("The quick brown fox"):
                b1 = residual(model, 1).save()
                b2 = residual(model, 2).save()
                bl = model.logits.clone().save()
        return [a0, a3, b1, b2, bl]

    for got, want in zip(run(pp), run(ref)):
        assert_close(got, want)


# ``tracer.cache()`` across stages: each stage's ``Cache`` records the modules that ran there; the merge
# actor unions them (``merge.book.merge_caches``). On the layouts' engines (a PP=2 engine of its own cost the
# suite one engine start).
cached_layouts = pytest.mark.parametrize("engine", ["pp2", "tp2pp2"], indirect=True, scope="module")


def cached(model, **kwargs):
    with model.trace(PROMPT, temperature=0.0, top_p=1, max_tokens=1) as tracer:
        cache = tracer.cache(**kwargs)
    return cache


def tensors_of(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    return []


def cache_differences(got, ref, expect=lambda path, tensor: tensor) -> list[str]:
    """Paths whose cached outputs differ; ``expect(path, tensor)`` turns a one-device value into the one wanted."""
    wrong = []
    # A path of one component (the root, "model") cannot be looked up in a cache that crossed a process
    # boundary (nnsight resolves it through the dropped envoy), on LocalVLLM as here.
    for path in (p for p in ref.keys() if "." in p):
        expected, actual = tensors_of(ref[path].output), tensors_of(got[path].output)
        if len(actual) != len(expected):
            wrong.append(f"{path}: {len(actual)} tensors, one device {len(expected)}")
            continue
        for a, e in zip(actual, expected):
            e = expect(path, e)
            err = ((a.float() - e.float()).norm() / e.float().norm().clamp_min(1e-12)).item() if a.shape == e.shape else None
            if err is None or err >= 1e-3:
                wrong.append(f"{path}: {tuple(a.shape)} vs {tuple(e.shape)}, relative error {err}")
                break
    return wrong


def tensor_parallel_value(path: str, whole: torch.Tensor, tp: int = 2) -> torch.Tensor:
    """What nnsight 0.8.1 gives at TP=``tp`` for the module at ``path``, from the one-device value ``whole``.

    nnsight gathers a column-parallel layer's output by concatenating the ranks' pieces in rank order
    (``VLLMFragments``); for a fused layer that is each rank's share of every part, rank by rank, not
    the one-device layout (q | k | v, gate | up). A value inside a layer that is not itself parallel
    (attention's per-head output, the MLP's activation) is never gathered: it is tensor-parallel rank 0's
    piece, as for a plain ``.save()`` (nnsight reports one TP rank's values, its reads being gathered). The
    tiny Llama has as many KV heads as heads, so q, k and v are equal thirds.
    """
    parts = 3 if path.endswith(".qkv_proj") else 2 if path.endswith(".gate_up_proj") else 0
    if parts:
        pieces = [part.chunk(tp, dim=-1) for part in whole.chunk(parts, dim=-1)]
        return torch.cat([piece[rank] for rank in range(tp) for piece in pieces], dim=-1)
    if path.endswith((".self_attn.attn", ".mlp.act_fn")):
        return whole.chunk(tp, dim=-1)[0]
    return whole


@cached_layouts
def test_full_cache_matches_single_device(engine, pp, ref):
    """Every module's cached output is the one-device value, as nnsight defines it at the engine's TP.

    At TP=2 (``tp2pp2``) the fused and the rank-local modules differ from one device by layout
    (``tensor_parallel_value``); a finding of CI at 967ec72, written down in docs/nnsight-suite.md.
    """
    want, got = cached(ref), cached(pp)
    layers = [f"model.model.layers.{i}" for i in range(N_LAYERS)]
    assert all(path in got for path in layers), got
    assert set(got.keys()) == set(want.keys())
    tensor_parallel = engine[0] == "tp2pp2"
    as_one_device = [w.split(":")[0] for w in cache_differences(got, want) if ".rotary_emb:" not in w]
    by_layout = [f"model.model.layers.{i}.{module}" for i in range(N_LAYERS) for module in
                 ("self_attn.qkv_proj", "self_attn.attn", "mlp.gate_up_proj", "mlp.act_fn")]
    assert sorted(as_one_device) == (sorted(by_layout) if tensor_parallel else []), as_one_device
    wrong = cache_differences(got, want, tensor_parallel_value if tensor_parallel else (lambda path, tensor: tensor))
    # vLLM builds one rotary embedding (``get_rope`` caches it) and every layer's attention holds it: on one
    # device each layer's ``rotary_emb`` path records all four layers' calls, on a stage only its own layers'.
    shared = [w for w in wrong if ".rotary_emb:" in w]
    assert [w for w in wrong if w not in shared] == []
    assert all("2 tensors" in w or "4 tensors" in w for w in shared), shared


@cached_layouts
def test_cache_of_selected_modules_from_both_stages(pp, ref):
    modules = lambda m: [m.model.layers[0], m.model.layers[-1]]  # noqa: E731
    want, got = cached(ref, modules=modules(ref)), cached(pp, modules=modules(pp))
    assert sorted(got.keys()) == sorted(want.keys()) == ["model.model.layers.0", "model.model.layers.3"]
    assert "model.model.layers.1" not in got
    for path in want.keys():
        for a, e in zip(tensors_of(got[path].output), tensors_of(want[path].output)):
            assert_close(a, e)


# --- 2. edits on any stage -----------------------------------------------------


def edited(model, edit, read: tuple = (2, 3)) -> dict:
    with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        edit(model)
        late = nnsight.save([residual(model, i) for i in read])
        logits = model.logits.clone().save()
        result = tracer.result.save()
    return {"late": late, "logits": logits, "tokens": list(result.outputs[0].token_ids)}


def scale_first_layer(model):
    model.model.layers[0].output[0][:] *= 3.0


def swap_second_layer(model):
    hidden, res = model.model.layers[1].output
    model.model.layers[1].output = (hidden * -1.0, res)


@pipelines
@pytest.mark.parametrize("edit", [scale_first_layer, swap_second_layer])
def test_edit_on_first_stage_changes_later_stages(pp, ref, edit):
    got, want = edited(pp, edit), edited(ref, edit)
    plain = read_everything(ref)
    assert not torch.allclose(want["logits"], plain["logits"]), "the edit should change the logits"
    assert got["tokens"] == want["tokens"]
    assert_close(got["logits"], want["logits"])
    for g, w in zip(got["late"], want["late"]):
        assert_close(g, w)


@pipelines
def test_edit_on_last_stage(pp, ref):
    def zero_layer_two(model):
        model.model.layers[2].output[0][:] = 0

    got, want = edited(pp, zero_layer_two), edited(ref, zero_layer_two)
    assert got["tokens"] == want["tokens"]
    assert_close(got["logits"], want["logits"])


# --- 3. cross-stage dependencies ------------------------------------------------


@pipelines
def test_value_from_stage_zero_used_on_stage_one(pp, ref):
    def add_layer_one(model):
        h = model.model.layers[1].output[0].clone()
        model.model.layers[3].output[0][:] += h

    got, want = edited(pp, add_layer_one, read=(3,)), edited(ref, add_layer_one, read=(3,))
    plain = read_everything(ref)
    assert not torch.allclose(want["logits"], plain["logits"])
    assert got["tokens"] == want["tokens"]
    assert_close(got["logits"], want["logits"])
    for g, w in zip(got["late"], want["late"]):
        assert_close(g, w)


@pipelines
def test_later_value_read_from_earlier_code_is_ordered_by_the_forward(pp, ref):
    """Reading layer 3 and then layer 0 in one step is out of order on one device, and here."""

    def run(model):
        with model.trace(PROMPT, temperature=0.0, max_tokens=1):
            b = residual(model, 3).save()
            a = residual(model, 0).save()
        return a, b

    with pytest.raises(Exception, match="OutOfOrderError") as on_one_device:
        run(ref)
    with pytest.raises(Exception, match="OutOfOrderError") as on_pipeline:
        run(pp)
    assert "model.model.layers.0.output" in str(on_one_device.value) and "model.model.layers.0.output" in str(on_pipeline.value)


# --- 4. generation ----------------------------------------------------------------


def generate_all(model, steps: int = 4) -> dict:
    with model.trace("Hello", temperature=0.0, max_tokens=steps) as tracer:
        early = nnsight.save([])
        late = nnsight.save([])
        logits = nnsight.save([])
        samples = nnsight.save([])
        for step in tracer.all():
            early.append(residual(model, 1))
            late.append(residual(model, 3))
            logits.append(model.logits.clone())
            samples.append(model.samples.clone())
        # (the open loop ends when generation does; nothing after it runs)
    return {"early": early, "late": late, "logits": logits, "samples": samples}


@pipelines
def test_generation_all_steps_on_both_stages(pp, ref):
    got, want = generate_all(pp), generate_all(ref)
    assert len(got["early"]) == len(want["early"]) == 4
    assert [s.tolist() for s in got["samples"]] == [s.tolist() for s in want["samples"]]
    for key in ("early", "late", "logits"):
        for step, (g, w) in enumerate(zip(got[key], want[key])):
            assert_close(g, w), (key, step)


@pipelines
def test_generation_with_a_dependency_every_step(pp, ref):
    def run(model):
        with model.trace("Hello", temperature=0.0, max_tokens=4) as tracer:
            samples = nnsight.save([])
            late = nnsight.save([])
            for step in tracer.all():
                h = model.model.layers[1].output[0].clone()
                model.model.layers[3].output[0][:] += h
                late.append(residual(model, 3))
                samples.append(model.samples.clone())
        return samples, late

    (got_samples, got_late), (want_samples, want_late) = run(pp), run(ref)
    assert [s.tolist() for s in got_samples] == [s.tolist() for s in want_samples]
    for g, w in zip(got_late, want_late):
        assert_close(g, w)


@pipelines
def test_iter_selected_steps(pp, ref):
    def run(model):
        with model.trace("Hello", temperature=0.0, max_tokens=4) as tracer:
            picked = nnsight.save([])
            for step in tracer.iter[1:3]:
                model.model.layers[0].output[0][:] *= 0.5  # an edit on stage 0 at steps 1 and 2 only
                picked.append(residual(model, 2))
                picked.append(model.logits.clone())
            result = tracer.result.save()
        return picked, list(result.outputs[0].token_ids)

    (got, got_tokens), (want, want_tokens) = run(pp), run(ref)
    assert got_tokens == want_tokens and len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert_close(g, w)


@pipelines
def test_registered_block_spanning_stages(pp, ref):
    def run(model):
        with model.edit() as (tracer, edit):
            a = model.model.layers[0].output[0].clone().save()
            b = model.model.layers[3].output[0].clone().save()
        try:
            outputs = model.generate(["Hello world", "Hi"], max_tokens=2, temperature=0.0)
        finally:
            edit.clear()
        return [(o.saves["a"], o.saves["b"], list(o.outputs[0].token_ids)) for o in outputs]

    for (ga, gb, gt), (wa, wb, wt) in zip(run(pp), run(ref)):
        assert gt == wt
        assert_close(ga, wa)
        assert_close(gb, wb)
    # Cleared on every stage: the next request carries no copies.
    outputs = pp.generate(["Hi"], max_tokens=1, temperature=0.0)
    assert not getattr(outputs[0], "saves", {})


# --- 5. clear failures ------------------------------------------------------------


@pipelines
def test_error_on_second_stage_reaches_the_caller(pp):
    from nnsight_ray.errors import RequestError

    with pytest.raises(RequestError, match="mat1 and mat2 shapes cannot be multiplied"):
        with pp.trace(PROMPT, temperature=0.0, max_tokens=3):
            hidden = pp.model.layers[3].output[0]
            (hidden @ torch.ones(3, 3)).save()
    # The engine serves the next trace normally.
    assert read_everything(pp)["tokens"]


@pipelines
def test_edit_from_a_later_stages_value_fails_clearly(pp):
    from nnsight_ray.errors import RequestError

    with pytest.raises(RequestError) as caught:
        with pp.trace("Hello", temperature=0.0, max_tokens=3) as tracer:
            previous = None
            for step in tracer.all():
                if step:
                    pp.model.layers[0].output[0][:] += previous
                previous = pp.model.layers[3].output[0][-1].clone()
    text = str(caught.value)
    assert "PipelineDependencyError" in text
    assert "model.model.layers.0.output on pipeline stage 0 depends on model.model.layers.3.output" in text


@pipelines
def test_control_flow_on_a_later_stages_value_fails_clearly(pp, ref):
    def run(model):
        with model.trace("Hello", temperature=0.0, max_tokens=3) as tracer:
            out = nnsight.save([])
            for step in tracer.all():
                out.append(residual(model, 1))
                if model.model.layers[3].output[0].sum() > 0:
                    out.append(residual(model, 3))
        return out

    assert len(run(ref)) >= 3  # fine on one device
    with pytest.raises(Exception) as caught:
        run(pp)
    text = str(caught.value)
    assert "PipelineDependencyError" in text and "needs the value of model.model.layers.1.output" in text
    assert "at step 1" in text and "GhostStop: bool() of model.model.layers.3.output" in text


# --- 6. whatever dies, every waiter gets out (last on their engines) ---------------
#
# Each kill starts the four kinds of waiter on the deployment (a blocking
# two-invoke trace, a non-blocking trace's ref, a plain generate, an async
# stream), kills one actor, and checks that every waiter fails within 10 s with
# the deployment's one death message (what died, which actor, which node), that
# health() says so, and that a new call fails at once with the same message.

LONG = dict(temperature=0.0, max_tokens=200, ignore_eos=True)
WAIT_S = 10.0


def start_waiters(model, streamer) -> dict:
    """Start one waiter of each kind on ``model`` (``streamer``: the same deployment, mode="async")."""
    import asyncio
    import threading

    from nnsight_ray._internal.observe.timeline import ADDED

    outcomes: dict = {}

    def run(kind, call):
        try:
            outcomes[kind] = ("returned", call())
        except BaseException as error:  # noqa: BLE001 - recorded and asserted
            outcomes[kind] = ("raised", error, time.monotonic())

    def blocking():
        with model.trace(**LONG) as tracer:
            with tracer.invoke("Hello world"):
                a = model.model.layers[0].output[0].save()
            with tracer.invoke("The quick brown fox"):
                b = model.model.layers[0].output[0].save()
        return a, b

    async def stream():
        with streamer.trace("Hello world", **LONG) as tracer:
            streamer.model.layers[0].output[0].save()
        return [output async for output in tracer.backend]

    since = time.monotonic()
    with model.trace("abc", blocking=False, **LONG) as tracer:
        model.model.layers[0].output[0].save()
    threads = [threading.Thread(target=run, args=args, daemon=True) for args in [
        ("blocking trace", blocking),
        ("generate", lambda: model.generate(["a", "b"], **LONG)),
        ("non-blocking ref", lambda: tracer.collect()),
        ("async stream", lambda: asyncio.run(stream())),
    ]]
    for thread in threads:
        thread.start()
    # Every request in the engine (1 + 2 + 2 + 1 adds), then the kill: a fixed 2 s wait let the first
    # one finish before the kill on a fast day (CI at 19e7b2d: "non-blocking ref returned {}").
    until = time.monotonic() + 30
    while time.monotonic() < until and sum(e[1] == ADDED for e in model.timeline(since)["engine"]) < 6:
        time.sleep(0.05)
    time.sleep(0.2)  # the last adds reach vLLM's engine core
    return {"outcomes": outcomes, "threads": threads, "ref": tracer.ref}


def assert_every_waiter_fails(waiters: dict, killed_at: float, *names: str) -> str:
    """Every waiter raised EngineDeadError within WAIT_S of the kill, each naming ``names``; the message."""
    from nnsight_ray.errors import EngineDeadError

    for thread in waiters["threads"]:
        thread.join(timeout=max(0.1, killed_at + WAIT_S + 5 - time.monotonic()))
    outcomes = waiters["outcomes"]
    assert sorted(outcomes) == sorted(["blocking trace", "generate", "non-blocking ref", "async stream"]), \
        f"still waiting after {WAIT_S + 5:.0f} s: {outcomes}"
    messages = set()
    for kind, outcome in outcomes.items():
        assert outcome[0] == "raised", f"{kind} returned {outcome[1]!r}"
        error, at = outcome[1], outcome[2]
        assert isinstance(error, EngineDeadError), f"{kind}: {type(error).__name__}: {error}"
        assert at - killed_at < WAIT_S, f"{kind} waited {at - killed_at:.1f} s"
        for name in names:
            assert name in str(error), f"{kind}: {error}"
        messages.add(str(error))
    assert len(messages) == 1, messages  # one message for everyone
    return messages.pop()


def assert_dead_everywhere(model, message: str, dead_actor: str) -> None:
    """health() names the dead actor; a new call fails at once with the same message."""
    from nnsight_ray.errors import EngineDeadError

    health = model.health()
    assert health["alive"] is False and health["error"] == message
    states = {a["name"]: a["state"] for a in health["actors"]}
    assert states[dead_actor] == "DEAD", states
    assert {a["role"] for a in health["actors"]} == {"engine", "merge", "rank"}
    began = time.monotonic()
    with pytest.raises(EngineDeadError) as later:
        with model.trace("Hello", temperature=0.0, max_tokens=1):
            model.model.layers[0].output[0].save()
    assert str(later.value) == message and time.monotonic() - began < 5


def nothing_left(name: str) -> None:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith(f"{name}.")], names
    groups = [pg for pg in ray.util.placement_group_table().values()
              if pg.get("name") == f"{name}.ranks" and pg["state"] != "REMOVED"]
    assert not groups, groups


def kill_and_check(model, name: str, actor_name: str, *expected: str, kill=None) -> None:
    """Kill one actor of deployment ``name`` with every kind of waiter in flight; all fail naming it, later calls too.

    ``kill``: another way to kill (then ``actor_name`` is one that dies of it).
    """
    from nnsight_ray import RayVLLM

    streamer = RayVLLM.connect(name, mode="async")
    waiters = start_waiters(model, streamer)
    if kill is None:
        ray.kill(ray.get_actor(actor_name, namespace="nnsight_ray"))
    else:
        kill()
    message = assert_every_waiter_fails(waiters, time.monotonic(), *expected)
    assert_dead_everywhere(model, message, actor_name)


@pytest.mark.parametrize("engine", ["pp2"], indirect=True, scope="module")
def test_killed_rank_or_merge_fails_every_waiter_and_engine_rebuilds(engine, model_dir, reference):
    """Stage 1's rank dies mid-generation: every waiter fails fast, naming it and its node; rebuilt, then
    its merge actor dies the same way.

    The last test on the ``pp2`` engine (pytest runs a layout's tests in file
    order); the rebuilt deployment takes the same name and matches the
    single-device reference.
    """
    from nnsight_ray import RayVLLM

    name, victim = engine
    dead = victim.topology()[1]
    kill_and_check(victim, name, dead["actor_name"], dead["actor_name"], dead["node_id"], "rank pp1.tp0")
    victim.shutdown()
    nothing_left(name)

    rebuilt = RayVLLM(model_dir, name=name, **LAYOUTS[name], **ENGINE_KWARGS)
    try:
        check_against(reference, rebuilt)
        merge = f"{name}.merge0"  # now its merge actor
        kill_and_check(rebuilt, name, merge, f"merge actor {merge} on node ")
    finally:
        rebuilt.shutdown()
    nothing_left(name)


@pytest.mark.parametrize("engine", ["tp2pp2"], indirect=True, scope="module")
def test_killed_tp_rank_engine_actor_or_core_process_fail_every_waiter(engine, model_dir):
    """A tensor-parallel rank dies (the issue's TP=2 case); on a rebuilt (PP=2) deployment, the engine actor
    (the merge actor's watch fails every waiter, naming it); on another, vLLM's engine-core process
    (SIGKILL: the ranks it owns die with it, and the message names the process, not a rank).
    Shutdown cleans up every time.

    The last test on ``tp2pp2``; the module fixture's teardown then checks
    that no placement group of ours is left.
    """
    from nnsight_ray import RayVLLM

    name, victim = engine
    dead = victim.topology()[1]
    assert (dead["pp_rank"], dead["tp_rank"]) == (0, 1)
    kill_and_check(victim, name, dead["actor_name"], dead["actor_name"], dead["node_id"], "rank pp0.tp1")
    victim.shutdown()
    nothing_left(name)

    # The engine actor's and the core process's deaths do not depend on the layout: two ranks
    # (PP=2) start faster than four on the suite's two cores. Not one rank: its waiters' work
    # finishes before the kill lands (CI at 967ec72: "generate returned ...").
    rebuilt = RayVLLM(model_dir, name=name, **LAYOUTS["pp2"], **ENGINE_KWARGS)
    try:
        kill_and_check(rebuilt, name, f"{name}.engine", f"engine actor {name}.engine on node ")
    finally:
        rebuilt.shutdown()
    nothing_left(name)

    rebuilt = RayVLLM(model_dir, name=name, **LAYOUTS["pp2"], **ENGINE_KWARGS)
    try:
        (pid,) = rebuilt.health()["core_pids"]
        kill_and_check(rebuilt, name, f"{name}.pp0.tp0", f"vLLM's engine core process (pid {pid})",
                       f"engine actor {name}.engine", "exited with code -9",
                       kill=lambda: os.kill(pid, signal.SIGKILL))
    finally:
        rebuilt.shutdown()
    nothing_left(name)
