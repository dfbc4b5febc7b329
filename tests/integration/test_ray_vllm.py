"""RayVLLM as users meet it: shared named deployments, ObjectRefs, concurrency, bad input.

Values are checked against nnsight's in-process engine (``local_llama``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import nnsight
import pytest
import ray
import torch

from conftest import ENGINE_KWARGS, assert_close, layer_and_logits, multi_invoke, request_counts
from reference import assert_outputs_as_results

pytestmark = pytest.mark.integration



@pytest.fixture(autouse=True)
def no_leaked_workers(ray_tp1):
    yield
    assert request_counts(ray_tp1) == [0]


def test_multi_invoke_and_edits_match_local(ray_tp1, local_llama):
    for got, want in zip(multi_invoke(ray_tp1), multi_invoke(local_llama)):
        assert_close(got, want)


def test_per_sequence_saves_with_n2(ray_tp1, local_llama):
    def run(model):
        # n > 1 needs sampling; a per-request seed makes it reproducible.
        with model.trace("Hello", temperature=0.8, seed=1234, max_tokens=2, n=2) as tracer:
            logits = model.logits.clone().save()
        return logits

    got, want = run(ray_tp1), run(local_llama)
    assert isinstance(got, list) and len(got) == 2
    for g, w in zip(got, want):
        assert_close(g, w)


def test_non_blocking_ref_resolves_in_another_task(ray_tp1, local_llama):
    with ray_tp1.trace("Hello world", temperature=0.0, max_tokens=1, blocking=False) as tracer:
        hidden = ray_tp1.model.layers[2].output[0].clone().save()
    assert isinstance(tracer.ref, ray.ObjectRef)

    @ray.remote(num_cpus=0)
    def norm_of(saves):
        return float(saves["hidden"].norm())

    want, _ = layer_and_logits(local_llama, "Hello world")
    assert abs(ray.get(norm_of.remote(tracer.ref)) - float(want.norm())) < 1e-3 * float(want.norm())
    assert set(ray.get(tracer.ref)) == {"hidden"}  # {name: value}, as README says
    assert_close(ray.get(tracer.ref)["hidden"], want)
    assert_close(tracer.collect()["hidden"], want)


def test_outputs_come_home_with_the_values_without_a_block_waiting_on_the_result(ray_tp1, local_llama):
    """trace(blocking=False, outputs=True): each invoke's prompt ids, tokens and text, as tracer.result has them."""
    prompts = ["Hello world", "seven!!"]
    with ray_tp1.trace(temperature=0.0, max_tokens=4, blocking=False, outputs=True) as tracer:
        hidden = nnsight.save([None, None])
        for i, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                hidden[i] = ray_tp1.model.layers[2].output[0].clone()
    values, outputs = tracer.collect()
    assert_outputs_as_results(outputs, ray_tp1, prompts, temperature=0.0, max_tokens=4)
    for i, prompt in enumerate(prompts):
        want, _ = layer_and_logits(local_llama, prompt)
        assert_close(values["hidden"][i], want)
    with pytest.raises(ValueError, match="needs blocking=False"):
        ray_tp1.trace("Hello", outputs=True)


def test_nnsight_keywords_are_taken_and_prefix_caching_is_off_by_default(ray_tp1):
    """RayVLLM takes nnsight VLLM's keywords with nnsight's defaults (issue 14.2).

    The session's ``tp1`` was built with ``enforce_eager=True`` (nnsight pops it;
    it used to fail here), and ``RayVLLM.connect`` rebuilds a client from that
    spec. Prefix caching is off unless asked for, as nnsight has it: a
    registered block on plain requests of one repeated prompt sees every
    prompt token every time (a cached prefix would skip its forward).
    """
    from nnsight_ray import RayVLLM

    again = RayVLLM.connect("tp1")  # the fixture built it with enforce_eager=True
    prompt = "one prompt sent again and again, whose prefix a cache would keep " * 2
    with again.edit() as (tracer, edit):
        hidden = again.model.layers[0].output[0].save()  # noqa: F841 - the registered save
    try:
        for _ in range(3):
            (output,) = again.generate([prompt], max_tokens=1, temperature=0.0)
            assert output.saves["hidden"].shape[0] == len(output.prompt_token_ids)
    finally:
        edit.clear()


def test_a_call_on_an_idle_engine_starts_in_one_step_and_the_scheduler_goes_on(ray_tp1):
    """An idle engine holds vLLM's scheduler while a call's requests are added (``EngineCore._hold``):
    the call's first step prefills every prompt (unheld, the core stepped on the first arrivals:
    ``python -m benchmarks.gpu --cpu`` showed a first step of 30 tokens of 2,550), and the scheduler runs
    again after (a second call finishes)."""
    from nnsight_ray._internal.observe.timeline import STEP

    prompts = [f"prompt {i}: the quick brown fox jumps" for i in range(24)]
    since = time.monotonic()
    outputs = ray_tp1.generate(prompts, max_tokens=2, temperature=0.0)
    steps = sorted(e for e in ray_tp1.timeline(since)["ranks"][0] if e[1] == STEP)
    assert steps[0][2] == sum(len(o.prompt_token_ids) for o in outputs)
    assert len(steps) == 2  # prefill (first token), one decode
    (again,) = ray_tp1.generate(["Hello"], max_tokens=1, temperature=0.0)
    assert len(again.outputs[0].token_ids) == 1


def test_the_engine_actor_freezes_its_startup_heap(ray_tp1):
    """The engine actor freezes its startup heap once the engine is up, as vLLM's API server does:
    a full collection then skips torch's, vLLM's and Ray's objects (one paused a large submit 0.5 s)."""
    health = ray_tp1.health()
    assert health["alive"], health
    assert health["gc_frozen"] > 100_000, health["gc_frozen"]  # torch + vLLM + Ray: millions of objects


def test_the_merge_actor_freezes_its_startup_heap(ray_tp1):
    """Each merge actor freezes its heap once it knows its ranks, as the engine actor does: a full
    collection there held a 2,048-prompt result for 0.4 s on the H200."""
    for merge in ray_tp1.vllm_entrypoint.merges:
        stats = ray.get(merge.stats.remote(), timeout=60)
        assert stats["gc_frozen"] > 100_000, stats  # torch + vLLM + Ray
        assert stats["gc_unfrozen"] < 50_000, stats  # what a full collection scans: not the startup heap


def test_a_merge_actor_freezes_its_heap_whatever_froze_before(ray_cluster):
    """On the H200 something in a merge actor's process froze 375 objects before the actor froze its heap, and
    a guard on ``gc.get_freeze_count()`` then skipped the freeze: 770k objects stayed for a full collection to
    scan, 0.4-0.7 s in the third run of every engine's first workload. Here the worker freezes
    part of its heap while the actor still imports vLLM (its start-up thread), then the actor freezes once."""
    import gc

    from nnsight_ray._internal.deploy import MergeActor

    merge = ray.remote(MergeActor).options(num_cpus=0).remote("test-merge-early-freeze")
    try:
        assert ray.get(merge.__ray_call__.remote(lambda self: (gc.freeze(), gc.get_freeze_count())[1]),
                       timeout=120) > 0  # a freeze came first
        ray.get(merge.set_ranks.remote([]), timeout=120)
        ray.get(merge.__ray_call__.remote(lambda self: self._prewarm.join(60)), timeout=90)  # every import done
        stats = ray.get(merge.stats.remote(), timeout=60)
        assert stats["gc_unfrozen"] < 50_000, stats  # vLLM and torch, imported after the hook, frozen too
    finally:
        ray.kill(merge)


def test_every_rank_freezes_its_startup_heap(ray_tp1, ray_tp2):
    """Each rank's heap is frozen after vLLM's warm-up: vLLM's GPU worker does it, its CPU worker does not
    (vLLM 0.32), so ours does. Unfrozen, a full collection took 369 ms of a rank's every-step run."""
    for model in (ray_tp1, ray_tp2):
        frozen = [rank["gc_frozen"] for rank in model.topology()]
        assert len(frozen) >= 1 and all(f > 100_000 for f in frozen), frozen  # torch + vLLM + the model


def test_a_raising_non_blocking_trace_raises_its_type_here_and_in_a_task(ray_tp1, local_llama):
    """``ray.get(tracer.ref)`` raises the intervention's error, typed, as a Ray task error does."""
    with ray_tp1.trace("Hello world", temperature=0.0, max_tokens=1, blocking=False) as tracer:
        ray_tp1.model.layers[2].output[0][10_000].save()
    with pytest.raises(IndexError) as here:
        ray.get(tracer.ref, timeout=60)
    assert isinstance(here.value, ray.exceptions.RayTaskError)  # Ray's error, an IndexError too

    @ray.remote(num_cpus=0)
    def consume(saves):
        return "ran"

    with pytest.raises(IndexError):  # a task given the ref fails the same way, before it runs
        ray.get(consume.remote(tracer.ref), timeout=60)
    with pytest.raises(IndexError) as collected:  # collect(): the intervention's own error, as blocking
        tracer.collect(timeout=60)
    with pytest.raises(IndexError) as blocking:
        with local_llama.trace("Hello world", temperature=0.0, max_tokens=1):
            local_llama.model.layers[2].output[0][10_000].save()
    assert str(collected.value).splitlines()[0] == str(blocking.value).splitlines()[0]
    assert not isinstance(collected.value, ray.exceptions.RayTaskError)


def test_32_concurrent_traces_from_ray_tasks_get_their_own_values(ray_tp1, local_llama):
    prompts = [f"prompt number {i} " + "x" * (i % 7) for i in range(32)]

    @ray.remote(num_cpus=1)
    def client(batch):
        from nnsight_ray import RayVLLM

        model = RayVLLM.connect("tp1")
        tracers = []
        for prompt in batch:
            with model.trace(prompt, temperature=0.0, max_tokens=1, blocking=False) as tracer:
                hidden = model.model.layers[2].output[0][-1].clone().save()
            tracers.append(tracer)
        return [t.collect()["hidden"] for t in tracers]

    # Two client processes, 16 non-blocking traces each: all 32 are in flight at
    # once (each Ray worker that imports nnsight and vLLM costs ~10 CPU-seconds).
    batches = [prompts[i::2] for i in range(2)]
    results = ray.get([client.remote(b) for b in batches], timeout=600)
    for batch, values in zip(batches, results):
        for prompt, value in zip(batch, values):
            want, _ = layer_and_logits(local_llama, prompt)
            assert_close(value, want[-1])


def test_connect_from_a_separate_driver_process(ray_cluster, ray_tp1, local_llama, tmp_path):
    script = tmp_path / "other_driver.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, ray
        ray.init(address=sys.argv[1], namespace="nnsight_ray")
        from nnsight_ray import RayVLLM
        model = RayVLLM.connect("tp1")
        with model.trace("Hello world", temperature=0.0, max_tokens=1):
            hidden = model.model.layers[2].output[0].clone().save()
        torch.save(hidden, sys.argv[2])
    """))
    out = tmp_path / "hidden.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, str(script), ray_cluster.address, str(out)], check=True, timeout=300, env=env)
    want, _ = layer_and_logits(local_llama, "Hello world")
    assert_close(torch.load(out), want)


def test_bad_requests_fail_alone_while_others_succeed(ray_tp1, local_llama):
    from vllm import SamplingParams

    # A good non-blocking trace in flight while the bad ones fail.
    with ray_tp1.trace("Hello world", temperature=0.0, max_tokens=8, blocking=False) as good:
        hidden = ray_tp1.model.layers[2].output[0].clone().save()

    with pytest.raises(Exception, match="boom"):
        with ray_tp1.trace("Hello", temperature=0.0, max_tokens=1):
            ray_tp1.model.layers[0].output[0].save()
            raise ValueError("boom")

    with pytest.raises(Exception, match="nonexistent|has no attribute"):
        with ray_tp1.trace("Hello", temperature=0.0, max_tokens=1):
            ray_tp1.model.nonexistent.output.save()

    with pytest.raises(Exception, match="no edit is installed|nope"):
        with ray_tp1.trace("Hello", temperature=0.0, max_tokens=1, edits=["nope"]):
            ray_tp1.model.layers[0].output[0].save()

    # A malformed serialized block, sent the way nnsight ships one.
    bad = SamplingParams(temperature=0.0, max_tokens=1)
    bad.extra_args = {"nnsight_mediator": b"not a pickle"}
    outputs = ray_tp1.vllm_entrypoint.generate(["Hello"], bad)
    assert outputs[0].nnsight_error is not None

    want, _ = layer_and_logits(local_llama, "Hello world")
    assert_close(good.collect()["hidden"], want)
    # And the engine still serves the next trace.
    got, _ = layer_and_logits(ray_tp1, "Hello world")
    assert_close(got, want)


def test_bad_input_is_refused_in_words_and_an_int_prompt_is_what_local_makes_of_it(ray_tp1, local_llama):
    import uuid

    from vllm import SamplingParams

    from nnsight_ray.errors import RequestError

    with pytest.raises(TypeError, match=r"prompt 0 is NoneType None: give a string, a list of token ids"):
        with ray_tp1.trace(None, temperature=0.0, max_tokens=1):
            ray_tp1.model.layers[0].output[0].save()
    with pytest.raises(TypeError, match=r"sampling_params\[0\] is dict, not vllm.SamplingParams"):
        ray_tp1.vllm_entrypoint.generate(["Hello"], {"max_tokens": 1})
    with pytest.raises(TypeError, match=r"prompt 0 is int 5"):
        ray_tp1.generate(5, max_tokens=1)
    # A refusal inside vLLM (its EngineGenerateError has no message) comes back with its cause.
    engine = ray_tp1.vllm_entrypoint
    group = uuid.uuid4().hex
    engine.engine.submit.remote(group, [None], [SamplingParams(max_tokens=1)])
    with pytest.raises(RequestError, match=r"vLLM refused the request: TypeError: \w+"):
        engine.wait(engine._merge(group).outputs.remote(group, 1), timeout=60)

    # `model.trace(5)`: vLLM reads a list of ints as token ids, LocalVLLM included; so here.
    def token_five(model):
        with model.trace(5, temperature=0.0, max_tokens=2) as tracer:
            result = tracer.result.save()
        return list(result.prompt_token_ids), list(result.outputs[0].token_ids)

    assert token_five(ray_tp1) == token_five(local_llama)
    assert token_five(ray_tp1)[0] == [5]


def test_an_unpicklable_save_fails_alone_beside_a_good_trace_in_the_same_step(ray_tp1, local_llama):
    """Two traces finishing in one engine step share one collection; only the unpicklable one fails.

    Both are built first and submitted back to back while a long request keeps
    the engine stepping; whether they land in one step is up to the scheduler,
    so up to a few attempts are made, each checked, until one shares a step.
    """
    engine = ray_tp1.vllm_entrypoint
    want, _ = layer_and_logits(local_llama, "Hello world")
    with ray_tp1.trace("Hello", temperature=0.0, max_tokens=200, ignore_eos=True, blocking=False) as busy:
        ray_tp1.model.layers[0].output[0].save()
    shared = []
    for attempt in range(8):
        built = []
        submit = engine.trace_ref
        engine.trace_ref = lambda *request: built.append(request)
        try:
            with ray_tp1.trace("Hello world", temperature=0.0, max_tokens=3, blocking=False):
                hidden = ray_tp1.model.layers[2].output[0].clone().save()  # noqa: F841 - the trace's save
            with ray_tp1.trace("Hello world", temperature=0.0, max_tokens=3, blocking=False):
                ray_tp1.model.layers[2].output[0].save()
                gen = nnsight.save(i for i in range(3))  # noqa: F841 - a generator: pickle cannot carry it
        finally:
            engine.trace_ref = submit
        before = ray_tp1.health()["collect"]
        good, bad = [submit(*request) for request in built]
        assert_close(engine.wait(good, timeout=60)["hidden"], want)
        with pytest.raises(TypeError, match=r"could not serialize the saved value saves\['gen'\] \(generator\)"):
            engine.wait(bad, timeout=60)
        after = ray_tp1.health()["collect"]
        shared.append((after["calls"] - before["calls"], after["requests"] - before["requests"]))
        if shared[-1] == (1, 2):  # one collection carried both
            break
    busy.collect(timeout=120)
    assert shared[-1] == (1, 2), f"never in one step: (collections, requests) per attempt {shared}"


def test_oversized_prompt_fails_with_a_clear_error(ray_tp1):
    with pytest.raises(Exception, match="(?i)longer than|maximum|max_model_len|too long"):
        with ray_tp1.trace("x" * 1000, temperature=0.0, max_tokens=1):
            ray_tp1.model.layers[0].output[0].save()


def test_caller_that_dies_mid_request_leaks_nothing(ray_cluster, ray_tp1, tmp_path):
    script = tmp_path / "dying_caller.py"
    script.write_text(textwrap.dedent("""
        import os, sys, ray
        ray.init(address=sys.argv[1], namespace="nnsight_ray")
        from nnsight_ray import RayVLLM
        model = RayVLLM.connect("tp1")
        with model.trace("Hello world", temperature=0.0, max_tokens=120, ignore_eos=True, blocking=False) as tracer:
            hidden = model.model.layers[2].output[0].clone().save()
        # The submit is a fire-and-forget actor task: exiting at once could lose it inside this process
        # (nothing would then exist to leak). A later task on the same handle is delivered after it.
        ray.get(model.vllm_entrypoint.engine.ready.remote())
        os._exit(3)   # gone before the request finishes
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    merge = ray_tp1.vllm_entrypoint.merges[0]
    merged_before = ray.get(merge.stats.remote())["requests_merged"]
    result = subprocess.run([sys.executable, str(script), ray_cluster.address], timeout=300, env=env)
    assert result.returncode == 3
    # Wait for the orphaned request to finish and reach the merge actor, then
    # for everything it held to go (abandoned groups are dropped after
    # NNSIGHT_RAY_ABANDON_AFTER_S, 10 s in the tests).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stats = ray.get(merge.stats.remote())
        if stats["requests_merged"] > merged_before and stats["groups"] == 0 and request_counts(ray_tp1) == [0]:
            break
        time.sleep(1)
    assert stats["requests_merged"] > merged_before, "the orphaned request never finished"
    assert request_counts(ray_tp1) == [0]
    assert ray.get(ray_tp1.vllm_entrypoint.merges[0].stats.remote())["groups"] == 0
    assert ray_tp1.vllm_entrypoint.collective_rpc("nnsight_ray_stash_size") == [0]


def _placement_groups(name: str) -> list[str]:
    return [pg["state"] for pg in ray.util.placement_group_table().values() if pg.get("name") == name]


def _live_placement_groups(name: str) -> list[str]:
    return [state for state in _placement_groups(name) if state != "REMOVED"]


def _named_actors(prefix: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def test_a_detached_reservation_stays_until_reclaimed_by_name(ray_cluster, tmp_path):
    """A detached deployment's group outlives its driver (and is removed by name: shutdown, or
    the next deployment of that name in deploy.launch)."""
    from nnsight_ray._internal.cluster.placement import RankReservation, placement_group_name

    name = "killed-driver-detached"
    script = tmp_path / "reserving_driver.py"
    script.write_text(textwrap.dedent("""
        import sys, time, ray
        ray.init(address=sys.argv[1], namespace="nnsight_ray")
        from nnsight_ray._internal.cluster.placement import RankPlacement, plan_placement
        plan_placement(RankPlacement(engine_name=sys.argv[2], device="cpu"), 2, detached=True)
        print("reserved", flush=True)
        time.sleep(600)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen([sys.executable, str(script), ray_cluster.address, name],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert driver.stdout.readline().strip() == "reserved"
    finally:
        driver.kill()
        driver.wait(timeout=30)
    time.sleep(3)
    assert _live_placement_groups(placement_group_name(name)) == ["CREATED"]
    assert RankReservation.reclaim(placement_group_name(name)) == 1
    assert _live_placement_groups(placement_group_name(name)) == []


# -- async streaming (mode="async" is a client-side switch: same deployment) --


@pytest.fixture(scope="module")
def async_tp1(ray_tp1):
    from nnsight_ray import RayVLLM

    return RayVLLM.connect("tp1", mode="async")


def test_stream_yields_steps_before_finish_and_saves_on_last(async_tp1, local_llama):
    import asyncio

    async def run():
        with async_tp1.trace("Hello world", temperature=0.0, max_tokens=16, ignore_eos=True) as tracer:
            hidden = async_tp1.model.layers[2].output[0].clone().save()
        seen = []
        async for output in tracer.backend:
            seen.append(output)
        again = await tracer.backend
        return seen, again

    seen, again = asyncio.run(run())
    # vLLM's output collector merges steps a lagging consumer has not taken yet
    # (as in-process nnsight/AsyncLLM), so a busy host may see fewer than 16
    # outputs; each is a step further on, and only the last is finished.
    assert 2 <= len(seen) <= 16 and [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    lengths = [len(o.outputs[0].token_ids) for o in seen]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 16
    assert all(o.saves == {} for o in seen[:-1])
    want, _ = layer_and_logits(local_llama, "Hello world")
    assert_close(seen[-1].saves["hidden"], want)
    assert again is None  # consumed once, as in nnsight


def test_stream_closed_early_frees_workers_and_intervention_errors_raise(async_tp1, ray_tp1):
    import asyncio

    async def run():
        with async_tp1.trace("Hello world", temperature=0.0, max_tokens=100, ignore_eos=True) as tracer:
            async_tp1.model.layers[2].output[0].save()
        stream = tracer.backend.__aiter__()
        first = await stream.__anext__()
        await stream.aclose()
        with async_tp1.trace("Hello", temperature=0.0, max_tokens=2) as tracer:
            async_tp1.model.layers[0].output[0].save()
            raise KeyError("boom")
        with pytest.raises(KeyError, match="boom"):
            await tracer.backend
        return first

    first = asyncio.run(run())
    assert not first.finished
    deadline = time.monotonic() + 30
    while request_counts(ray_tp1) != [0] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert request_counts(ray_tp1) == [0]
