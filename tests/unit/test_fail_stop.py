"""Fail-stop logic with fakes (no Ray, no engine): every request reports, every waiter gets out.

``EngineCore`` runs over a fake vLLM ``AsyncLLM``; ``MergeBook`` and the
liveness helpers are driven directly.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from types import SimpleNamespace

import pytest
import torch
# vLLM's own engine-dead error, imported now: EngineCore imports it on first use, and a
# first import inside a scenario would block its event loop for seconds.
from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

from nnsight_ray._internal.cluster import liveness
from nnsight_ray._internal.engine.core import SHUTDOWN_AFTER_DEATH_S, EngineCore, Report
from nnsight_ray._internal.cluster.liveness import ActorRecord, ActorState
from nnsight_ray._internal.merge.book import MergeBook
from nnsight_ray._internal.merge.payload import dumps
from nnsight_ray._internal.ranks.rpcs import serialize_entry
from nnsight_ray.errors import EngineDeadError


def _vllm_dead(message: str = "engine core died") -> Exception:
    return VLLMEngineDead(message)


class FakeLLM:
    """vLLM's ``AsyncLLM`` surface that ``EngineCore`` uses; each prompt says how its request behaves.

    ``"ok"`` finishes after one step, ``"hang"`` never finishes, ``"die"``
    raises vLLM's engine-dead error once ``die`` is set, ``"bad"`` raises a
    ValueError at once. ``collective_rpc`` hangs while ``block_collect`` is set.
    """

    def __init__(self) -> None:
        self.errored = False
        self.die = asyncio.Event()
        self.block_collect = False
        self.rpcs: list[tuple] = []
        self.aborted: list[str] = []
        self.shut = False

    async def generate(self, prompt, param, request_id, lora_request=None):
        try:
            if prompt == "bad":
                raise ValueError("prompt must be a string")
            yield SimpleNamespace(finished=False, request_id=request_id)
            if prompt == "ok":
                yield SimpleNamespace(finished=True, request_id=request_id)
                return
            if prompt == "die":
                await self.die.wait()
                self.errored = True
                raise _vllm_dead()
            await asyncio.Event().wait()  # "hang"
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise

    async def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        if self.block_collect:
            await asyncio.Event().wait()
        return [None]

    def shutdown(self) -> None:
        self.shut = True


class Harness:
    def __init__(self, describe_delay_s: float = 0.0) -> None:
        self.llm = FakeLLM()
        self.reports: list[Report] = []
        self.told: list[str] = []

        async def describe() -> str:
            await asyncio.sleep(describe_delay_s)
            return "the engine is dead: rank pp0.tp1 (actor e.pp0.tp1) on node n1 died"

        self.core = EngineCore(self.llm, self.reports.extend, describe, on_dead=lambda e: self.told.append(str(e)))

    def by_id(self) -> dict[str, Report]:
        ids = [r.request_id for r in self.reports]
        assert len(ids) == len(set(ids)), f"a request was reported twice: {ids}"
        return {r.request_id: r for r in self.reports}


# Sampling params of a traced request: its block rides extra_args (nnsight's client puts it there).
BLOCK = SimpleNamespace(extra_args={"nnsight_mediator": b"block"})


async def _settle(steps: int = 20) -> None:
    for _ in range(steps):
        await asyncio.sleep(0)


def test_engine_death_while_requests_explain_it_still_reports_every_request_once():
    """The issue's hang: requests cancelled while awaiting ``_explain`` never reached ``finish``."""

    async def scenario():
        h = Harness(describe_delay_s=0.05)  # slow diagnosis: the others arrive in _explain meanwhile
        h.core.submit("g", ["die", "die", "die", "hang"], [None] * 4)
        await _settle()
        h.llm.die.set()
        await asyncio.sleep(0.3 + SHUTDOWN_AFTER_DEATH_S)  # vLLM's shutdown comes after the waiters
        return h

    h = asyncio.run(scenario())
    reports = h.by_id()
    assert sorted(reports) == ["g-0", "g-1", "g-2", "g-3"]
    for report in reports.values():
        assert isinstance(report.error, EngineDeadError) and "e.pp0.tp1" in str(report.error)
        assert report.output is None
    assert h.llm.shut and h.told == [str(h.core.dead)]


def test_fail_reports_requests_whose_collection_is_stuck():
    """A collection blocked in a collective with a dead rank: ``fail`` reports its requests itself."""

    async def scenario():
        h = Harness()
        h.llm.block_collect = True
        h.core.submit("g", ["ok", "ok"], [BLOCK, BLOCK])
        h.core.submit("h", ["hang"], [None])
        await _settle()
        assert h.llm.rpcs and not h.reports  # collecting, stuck
        await h.core.fail(EngineDeadError("the engine is dead: rank x died"))
        await _settle()
        # and a request after the death fails at once, with the same error
        h.core.submit("later", ["ok"], [None])
        await _settle()
        return h

    h = asyncio.run(scenario())
    reports = h.by_id()
    assert sorted(reports) == ["g-0", "g-1", "h-0", "later-0"]
    assert {str(r.error) for r in reports.values()} == {"the engine is dead: rank x died"}


def test_a_bad_request_fails_alone_and_good_ones_are_collected_together():
    async def scenario():
        h = Harness()
        h.core.submit("g", ["ok", "bad", "ok"], [BLOCK] * 3)
        await _settle()
        return h

    h = asyncio.run(scenario())
    reports = h.by_id()
    assert isinstance(reports["g-1"].error, ValueError) and reports["g-1"].output is None
    assert reports["g-0"].error is None and reports["g-0"].output.finished
    assert h.core.dead is None
    stash_calls = [args for method, args in h.llm.rpcs if method == "nnsight_ray_stash"]
    assert len(stash_calls) == 1 and sorted(stash_calls[0][0]) == ["g-0", "g-1", "g-2"]
    assert stash_calls[0][1:] == (None, "defer")  # no block parked on tracer.result: no outputs sent


def test_plain_requests_are_not_collected_unless_a_registered_block_may_have_run():
    """No collective for a request no block touched; one for the rest (issue 22, item 3)."""

    async def scenario():
        h = Harness()
        h.core.submit("plain", ["ok", "ok"], [None, SimpleNamespace(extra_args={"other": 1})])
        await _settle()
        assert not [m for m, _ in h.llm.rpcs if m == "nnsight_ray_stash"]
        h.core.submit("traced", ["ok"], [BLOCK])
        h.core.submit("named", ["ok"], [SimpleNamespace(extra_args={"nnsight_edits": ["probe"]})])
        await _settle()
        await h.core.rpc("nnsight_register", ("reg-1", b"payload", None))
        h.core.submit("registered", ["ok"], [None])
        await _settle()
        await h.core.rpc("nnsight_clear_registered", ("reg-1",))
        h.core.submit("cleared", ["ok"], [None])
        await _settle()
        return h

    h = asyncio.run(scenario())
    reports = h.by_id()
    collected = sorted(rid for m, args in h.llm.rpcs if m == "nnsight_ray_stash" for rid in args[0])
    assert collected == ["named-0", "registered-0", "traced-0"]
    assert {rid: r.collected for rid, r in reports.items()} == {
        "plain-0": False, "plain-1": False, "traced-0": True, "named-0": True, "registered-0": True,
        "cleared-0": False}
    assert all(r.error is None and r.output.finished for r in reports.values())
    assert h.core.registered == set()


def test_stash_put_expires_the_oldest_without_rescanning(monkeypatch):
    from nnsight_ray._internal.ranks import rpcs as rank_worker

    monkeypatch.setattr(rank_worker, "_stash", type(rank_worker._stash)())
    monkeypatch.setattr(rank_worker, "STASH_TTL_S", 10.0)
    now = [100.0]
    monkeypatch.setattr(rank_worker.time, "monotonic", lambda: now[0])
    rank_worker.stash_put("a", b"1")
    now[0] = 105.0
    rank_worker.stash_put("b", b"2")
    now[0] = 112.0  # a is 12 s old, b 7 s
    rank_worker.stash_put("c", b"3")
    assert list(rank_worker._stash) == ["b", "c"]
    assert rank_worker.stash_take(["a", "b"]) == [None, b"2"] and rank_worker.stash_size() == 1


def test_stream_ends_with_the_engines_error_when_it_dies():
    async def scenario():
        h = Harness()
        seen, caught = [], None

        async def consume():
            nonlocal caught
            try:
                async for output in h.core.stream("s", "hang", None):
                    seen.append(output)
            except EngineDeadError as error:
                caught = error

        consumer = asyncio.ensure_future(consume())
        await _settle()
        await h.core.fail(EngineDeadError("the engine is dead: engine actor e.engine died"))
        await asyncio.wait_for(consumer, 2)
        return h, seen, caught

    h, seen, caught = asyncio.run(scenario())
    assert len(seen) == 1 and "e.engine" in str(caught)
    assert list(h.by_id()) == ["s-0"]


def test_every_waiter_hears_of_the_death_before_vllms_blocking_shutdown():
    """vLLM's shutdown blocks the loop for seconds; a stream must not wait behind it (was 6 s vs 3 s)."""
    async def scenario():
        h = Harness()
        order: list[str] = []
        h.llm.shutdown = lambda: (order.append("shutdown"), time.sleep(0.3))

        async def consume():
            try:
                async for _ in h.core.stream("s", "hang", None):
                    pass
            except EngineDeadError:
                order.append("stream")

        consumer = asyncio.ensure_future(consume())
        h.core.submit("g", ["hang"], [None])
        await _settle()
        await h.core.fail(EngineDeadError("the engine is dead: rank e.pp0.tp1 died"))
        await asyncio.wait_for(consumer, 2)
        order.append("reported" if "g-0" in h.by_id() else "unreported")
        await asyncio.sleep(SHUTDOWN_AFTER_DEATH_S + 0.4)
        return order

    assert asyncio.run(scenario()) == ["stream", "reported", "shutdown"]


def test_stream_closed_early_aborts_and_reports():
    async def scenario():
        h = Harness()
        stream = h.core.stream("s", "hang", None)
        await stream.__anext__()
        await stream.aclose()
        await _settle()
        return h

    h = asyncio.run(scenario())
    assert h.llm.aborted == ["s-0"]
    report = h.by_id()["s-0"]
    assert report.output is None and "closed before it finished" in str(report.error)


def test_rpc_on_an_engine_that_dies_mid_call_raises_its_death():
    async def scenario():
        h = Harness()
        h.llm.block_collect = True
        call = asyncio.ensure_future(h.core.rpc("nnsight_request_count"))
        await _settle()
        await h.core.fail(EngineDeadError("the engine is dead: rank y died"))
        with pytest.raises(EngineDeadError, match="rank y"):
            await asyncio.wait_for(call, 2)
        with pytest.raises(EngineDeadError, match="rank y"):
            await h.core.rpc("nnsight_request_count")

    asyncio.run(scenario())


# -- MergeBook ----------------------------------------------------------------


def _report(group: str, index: int, output=None, error=None) -> Report:
    return Report(group, index, f"{group}-{index}", output, error)


def test_merge_fail_releases_every_waiter_and_later_waits_fail_at_once():
    async def scenario():
        book = MergeBook(abandon_after_s=30, ttl_s=3600)
        waiting = asyncio.ensure_future(book.wait("g", 2))
        await _settle()
        book.fail("the engine is dead: engine actor e.engine on node n died")
        with pytest.raises(EngineDeadError, match="e.engine on node n"):
            state = await asyncio.wait_for(waiting, 1)
            raise state.error
        with pytest.raises(EngineDeadError, match="e.engine on node n"):
            await asyncio.wait_for(book.wait("new", 1), 1)
        return book

    book = asyncio.run(scenario())
    assert book.stats()["dead"].startswith("the engine is dead") and book.stats()["waiting"] == 0


def test_merge_keeps_a_completed_groups_results_through_a_later_death():
    async def scenario():
        book = MergeBook(abandon_after_s=30, ttl_s=3600)
        book.arrive([_report("g", 0, error=RuntimeError("its own"))], [[None]])
        book.fail("dead")
        state = await book.wait("g", 1)
        return state

    state = asyncio.run(scenario())
    assert str(state.error) == "its own"


# -- liveness -----------------------------------------------------------------


def _entry(state: str, node: str, end_ms: float = 0.0) -> dict:
    return {"State": state, "Address": {"NodeID": node}, "EndTime": end_ms}


def test_dead_message_names_the_first_to_die_and_its_node():
    rank0 = ActorRecord(liveness.RANK, "e.pp0.tp0", "a0", "n0", label="rank pp0.tp0")
    rank1 = ActorRecord(liveness.RANK, "e.pp0.tp1", "a1", "n1", label="rank pp0.tp1")
    merge = ActorRecord(liveness.MERGE, "e.merge0", "m0")
    table = {"a0": _entry("DEAD", "n0", 2000), "a1": _entry("DEAD", "n1", 1000), "m0": _entry("ALIVE", "n2")}
    states = liveness.read_states([rank0, rank1, merge], table.get)
    message = liveness.dead_message(states, alive_nodes={"n0", "n2"})
    assert message.startswith("the engine is dead: rank pp0.tp1 (actor e.pp0.tp1) on node n1 (node removed) died")
    assert "model.shutdown()" in message
    assert [s.as_dict()["state"] for s in states] == ["DEAD", "DEAD", "ALIVE"]
    assert liveness.dead_message(states[2:], {"n2"}) is None


def test_a_merge_actors_death_is_named_as_a_merge_actor():
    merge = ActorRecord(liveness.MERGE, "e.merge0", "m0")
    states = liveness.read_states([merge], {"m0": _entry("DEAD", "n2", 5)}.get)
    assert "merge actor e.merge0 on node n2 (node alive) died" in liveness.dead_message(states, {"n2"})


def test_unreadable_actor_is_unknown_not_dead():
    def broken(actor_id):
        raise ConnectionError("GCS unavailable")

    states = liveness.read_states([ActorRecord(liveness.ENGINE, "e.engine", "x")], broken)
    assert states[0].state == "UNKNOWN" and not states[0].dead


def test_watch_loop_survives_a_failing_step():
    calls = []

    async def step() -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("transient")
        return True

    asyncio.run(asyncio.wait_for(liveness.every(0.0, step, "test watch"), 2))
    assert len(calls) == 3


# -- per-request serialization ---------------------------------------------------


def test_an_unpicklable_save_fails_only_its_request_and_names_the_value():
    good = serialize_entry("a", {"saves": {"h": 1.5}, "error": None, "registered": {}, "sequences": {}}, dumps)
    bad = serialize_entry("b", {"saves": {"ok": 2, "lock": threading.Lock()}, "error": None,
                                "registered": {}, "sequences": {}}, dumps)
    assert pickle.loads(good)["a"]["saves"] == {"h": 1.5}
    entry = pickle.loads(bad)["b"]
    assert entry["saves"] == {}
    assert entry["error"]["type_name"] == "TypeError"
    assert "saves['lock'] (lock)" in entry["error"]["message"] and "request b" in entry["error"]["message"]


def test_a_batch_take_serializes_each_request_alone_and_an_unpicklable_one_fails_alone():
    from nnsight_ray._internal.ranks import rpcs as rank_worker

    entry = lambda saves: {"saves": saves, "error": None, "registered": {}, "sequences": {}}  # noqa: E731
    rank_worker.stash_put("t1", entry({"h": torch.ones(2)}))
    rank_worker.stash_put("t2", entry({"lock": threading.Lock()}))
    rank_worker.stash_put("t3", b"")  # a request that saved nothing
    rank_worker.stash_put("t4", entry({"h": torch.zeros(3), "n": 4}))
    taken = rank_worker.take_serialized(["t1", "t2", "t3", "t4", "gone"])
    from nnsight_ray._internal.merge import payload

    def through_ray(value):  # what Ray does with the merge actor's call result: protocol 5, buffers out of band
        buffers: list = []
        data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        return pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in buffers])

    taken = [through_ray(t) for t in taken]
    assert torch.equal(payload.loads(taken[0])["t1"]["saves"]["h"], torch.ones(2))
    assert "saves['lock'] (lock)" in payload.loads(taken[1])["t2"]["error"]["message"]
    assert taken[2] == b"" and taken[4] is None
    assert payload.loads(taken[3])["t4"]["saves"]["n"] == 4
    assert rank_worker.stash_size() == 0


def test_actor_state_reports_its_cause():
    cause = SimpleNamespace(actor_died_error_context=SimpleNamespace(error_message="killed by\n `ray.kill`."))
    state = liveness.state_of(ActorRecord(liveness.ENGINE, "e.engine", "x"),
                              {"State": "DEAD", "Address": {"NodeID": "n"}, "EndTime": 1, "DeathCause": cause})
    assert isinstance(state, ActorState) and state.cause == "killed by `ray.kill`."
    assert liveness.dead_message([state]).startswith(
        "the engine is dead: engine actor e.engine on node n died (killed by `ray.kill`.)")


# -- bad input, refused in the caller --------------------------------------------


def test_bad_prompts_and_params_are_refused_in_words():
    from vllm import SamplingParams

    from nnsight_ray.ray_vllm import RemoteEngine

    lists = RemoteEngine._lists
    assert lists([5], None, None)[0] == [[5]]  # token id 5, as vLLM (and so LocalVLLM) reads it
    assert lists("hi", SamplingParams(), None)[0] == ["hi"]
    assert lists({"prompt_token_ids": [1, 2]}, None, None)[0] == [{"prompt_token_ids": [1, 2]}]
    with pytest.raises(TypeError, match=r"prompt 0 is NoneType None: give a string, a list of token ids"):
        lists([None], None, None)
    with pytest.raises(TypeError, match=r"prompt 0 is int 5"):
        lists(5, None, None)
    with pytest.raises(TypeError, match=r"prompt 1 is float"):
        lists(["a", 1.5], None, None)
    with pytest.raises(ValueError, match=r"prompt 0 is a dict with keys \['text'\]"):
        lists([{"text": "hi"}], None, None)
    with pytest.raises(TypeError, match=r"sampling_params\[0\] is dict, not vllm.SamplingParams"):
        lists(["hi"], {"max_tokens": 1}, None)


def test_vllms_empty_generate_error_comes_back_with_its_cause():
    from vllm.v1.engine.exceptions import EngineGenerateError

    from nnsight_ray._internal.engine.core import refusal
    from nnsight_ray.errors import RequestError

    try:
        try:
            raise TypeError("Prompt should be a string, list of tokens, or dictionary")
        except TypeError as cause:
            raise EngineGenerateError() from cause
    except EngineGenerateError as wrapped:
        error = refusal(wrapped)
    assert isinstance(error, RequestError)
    assert str(error) == "vLLM refused the request: TypeError: Prompt should be a string, list of tokens, or dictionary"
    plain = ValueError("has a message")
    assert refusal(plain) is plain


def test_a_dead_engine_core_process_is_blamed_over_the_ranks_it_took_with_it():
    rank = ActorRecord(liveness.RANK, "e.pp0.tp0", "a0", "n0", label="rank pp0.tp0")
    owner_died = SimpleNamespace(actor_died_error_context=SimpleNamespace(
        error_message="The actor is dead because its owner has died."))
    states = [liveness.state_of(rank, {"State": "DEAD", "Address": {"NodeID": "n0"}, "EndTime": 9,
                                       "DeathCause": owner_died})]
    core = "vLLM's engine core process (pid 7) of engine actor e.engine exited with code -9"
    assert liveness.diagnose(states, {"n0"}, core) == liveness.engine_dead(core)
    # a rank killed on its own is blamed even if the core then exits
    killed = [liveness.state_of(rank, {"State": "DEAD", "Address": {"NodeID": "n0"}, "EndTime": 9})]
    assert "rank pp0.tp0 (actor e.pp0.tp0)" in liveness.diagnose(killed, {"n0"}, core)
    assert liveness.diagnose([], set(), None) is None


def test_serve_check_health_keeps_failing_once_the_engine_is_dead():
    """Serve replaces a replica only after several failed checks in a row: a dead engine fails each."""
    from nnsight_ray.serve.deployment import NNsightDeployment

    replica = object.__new__(NNsightDeployment.func_or_class)
    replica.engine_name, replica.state, replica.error = "app-r1", "ready", None

    async def health():
        return {"alive": False, "error": "the engine is dead: rank pp1.tp0 (actor app-r1.pp1.tp0) died"}

    replica.engine = SimpleNamespace(engine=SimpleNamespace(health=SimpleNamespace(remote=health)))
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"rank pp1\.tp0"):
            asyncio.run(replica.check_health())
    assert replica.state == "dead"


def test_submitted_requests_ask_vllm_for_the_final_output_only_streams_for_every_step():
    """A submitted request reports only its finished output: vLLM is asked for that alone, as ``LLM.generate`` asks."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    seen: dict[str, object] = {}

    async def scenario():
        h = Harness()
        generate = h.llm.generate

        def recording(prompt, param, request_id, lora_request=None):
            seen[request_id] = param.output_kind
            return generate(prompt, param, request_id, lora_request)

        h.llm.generate = recording
        h.core.submit("g", ["ok", "ok"], [SamplingParams(max_tokens=2)] * 2)
        streamed = [item async for item in h.core.stream("s", "ok", SamplingParams(max_tokens=2))]
        await _settle()
        return h, streamed

    h, streamed = asyncio.run(scenario())
    assert seen == {"g-0": RequestOutputKind.FINAL_ONLY, "g-1": RequestOutputKind.FINAL_ONLY,
                    "s-0": RequestOutputKind.CUMULATIVE}
    assert len(streamed) == 2 and sorted(h.by_id()) == ["g-0", "g-1", "s-0"]


def test_a_merge_book_hands_its_death_message_to_who_waits_for_it():
    """``MergeBook.death``: the message as soon as ``fail`` is called, None if it is not in time."""
    from nnsight_ray._internal.merge.book import MergeBook

    async def scenario():
        book = MergeBook(abandon_after_s=10, ttl_s=60)
        assert await book.death(0.05) is None
        waiting = asyncio.ensure_future(book.death(5))
        await _settle()
        book.fail("the engine is dead: rank pp1.tp0 died")
        return await asyncio.wait_for(waiting, 1), await book.death(0)

    assert asyncio.run(scenario()) == ("the engine is dead: rank pp1.tp0 died",) * 2


class RenderingLLM(FakeLLM):
    """A fake ``AsyncLLM`` with vLLM's renderer surface: prompts render to ``{"type": "token", ...}``."""

    def __init__(self, fail: bool = False, hold: threading.Event | None = None) -> None:
        super().__init__()
        self.model_config = SimpleNamespace(is_encoder_decoder=False)
        self.events: list[tuple] = []
        llm = self

        class Renderer:
            default_cmpl_tok_params = "defaults"

            def render_cmpl(self, parsed, tok_params):  # called on a thread: the loop runs meanwhile
                llm.events.append(("render", [p["prompt"] for p in parsed], tok_params))
                time.sleep(0.02)  # tokenizing
                if hold is not None:
                    hold.wait(10)
                if fail:
                    raise ValueError("a prompt vLLM refuses")
                llm.events.append(("rendered",))
                return [{"type": "token", "prompt": p["prompt"], "prompt_token_ids": [len(p["prompt"])]}
                        for p in parsed]

        self.renderer = Renderer()

    async def generate(self, prompt, param, request_id, lora_request=None):
        self.events.append(("add", request_id, prompt))
        text = prompt["prompt"] if isinstance(prompt, dict) else prompt
        text = "ok" if text.startswith("ok") else text  # "okay", "ok!": finish like "ok"
        async for output in super().generate(text, param, request_id, lora_request):
            yield output


async def _reported(h: Harness, n: int, timeout: float = 10.0) -> None:
    """Until ``n`` requests are reported (the render runs on a thread, so the loop yields in real time)."""
    until = time.monotonic() + timeout
    while len(h.reports) < n and time.monotonic() < until:
        await asyncio.sleep(0.005)


def _rendering_harness(llm: RenderingLLM) -> Harness:
    h = Harness()
    h.llm = llm
    h.core = EngineCore(llm, h.reports.extend, lambda: asyncio.sleep(0, "dead"), on_dead=h.told.append)
    return h


def test_one_calls_prompts_render_together_then_start_together():
    """Every prompt of a call is rendered in one batch (vLLM's renderer, its defaults) before any is added,
    so they reach the engine core together; each request gets its own rendered input."""
    async def scenario():
        h = _rendering_harness(RenderingLLM())
        h.core.submit("g", ["ok", "okay", "ok!"], [None] * 3)
        await _reported(h, 3)
        return h

    h = asyncio.run(scenario())
    kinds = [e[0] for e in h.llm.events]
    assert kinds == ["render", "rendered", "add", "add", "add"]
    assert h.llm.events[0][1:] == (["ok", "okay", "ok!"], "defaults")
    added = {e[1]: e[2] for e in h.llm.events[2:]}
    assert added == {f"g-{i}": {"type": "token", "prompt": p, "prompt_token_ids": [len(p)]}
                     for i, p in enumerate(["ok", "okay", "ok!"])}
    assert all(r.error is None and r.output.finished for r in h.by_id().values())


def test_a_long_call_renders_in_batches_of_about_a_step_each_added_before_the_next_renders(monkeypatch):
    """2,048 long prompts: the core steps on the first batch while the next is tokenized."""
    from nnsight_ray._internal.engine import render as engine

    assert engine.render_batches(["a" * 5] * 5, 25) == [range(0, 5)]  # one step's worth: one batch
    assert engine.render_batches([{"prompt_token_ids": [1] * 5}, "x" * 5], 25) == [range(0, 2)]  # 20 + 5 chars
    assert engine.render_batches([], 25) == []
    # Longer than a step: from about 1/8 of a step (4 of 32 characters), doubling up to a step.
    assert engine.render_batches(["abcd"] * 40, 32) == [range(0, 1), range(1, 3), range(3, 7), range(7, 15),
                                                         range(15, 23), range(23, 31), range(31, 39), range(39, 40)]
    assert engine.render_batches(["a" * 100, "b"], 25) == [range(0, 1), range(1, 2)]  # a long prompt alone
    monkeypatch.setattr(engine, "RENDER_BATCH_CHARS", 6)
    monkeypatch.setattr(engine, "RENDER_RAMP", 1)

    async def scenario():
        h = _rendering_harness(RenderingLLM())
        h.core.submit("g", ["ok1", "ok2", "ok3", "ok4", "ok5"], [None] * 5)
        await _reported(h, 5)
        return h

    h = asyncio.run(scenario())
    kinds = [e[0] for e in h.llm.events]
    assert [e[1] for e in h.llm.events if e[0] == "render"] == [["ok1", "ok2"], ["ok3", "ok4"], ["ok5"]]
    second = [i for i, kind in enumerate(kinds) if kind == "rendered"][1]
    assert kinds.index("add") < second  # the first batch went in while the second was rendering
    added = {e[1]: e[2]["prompt"] for e in h.llm.events if e[0] == "add"}
    assert added == {f"g-{i}": f"ok{i + 1}" for i in range(5)}
    assert all(r.error is None and r.output.finished for r in h.by_id().values())


class HoldingLLM(RenderingLLM):
    """``RenderingLLM`` with vLLM's scheduler pause (``engine_core``) and its record of added requests."""

    def __init__(self) -> None:
        super().__init__()
        llm = self
        self.output_processor = SimpleNamespace(external_req_ids={})

        class Core:
            async def pause_scheduler_async(self, mode, clear_cache):
                llm.events.append(("pause", mode, clear_cache))

            async def resume_scheduler_async(self):
                llm.events.append(("resume",))

        self.engine_core = Core()

    async def generate(self, prompt, param, request_id, lora_request=None):
        self.output_processor.external_req_ids[request_id] = [f"{request_id}-internal"]
        async for output in super().generate(prompt, param, request_id, lora_request):
            yield output


def test_an_idle_engine_holds_its_scheduler_until_a_calls_adds_are_sent():
    """On an idle engine a call's requests are added with vLLM's scheduler paused ("keep": nothing steps)
    and resumed after the last add, so they start in one step; a busy engine is never paused."""
    from nnsight_ray._internal.engine import core as engine

    assert engine.HOLD_ADDS  # the default

    async def scenario():
        h = _rendering_harness(HoldingLLM())
        h.core.submit("g", ["ok", "okay", "ok!"], [None] * 3)
        await _reported(h, 3)
        idle = [e for e in h.llm.events if e[0] in ("pause", "add", "resume")]
        h.llm.events.clear()
        h.core.submit("busy", ["hang"], [None])  # one request in flight
        h.core.submit("g2", ["ok", "ok"], [None] * 2)
        await _reported(h, 5)
        busy = [e[0] for e in h.llm.events if e[0] in ("pause", "add", "resume")]
        return h, idle, busy

    h, idle, busy = asyncio.run(scenario())
    assert [e[0] for e in idle] == ["pause", "add", "add", "add", "resume"]
    assert idle[0] == ("pause", "keep", False)  # nothing steps; the KV cache stays
    assert busy == ["add", "add", "add"]


def test_a_batch_that_does_not_render_goes_request_by_request():
    """One refused prompt fails only its own request: the others are added raw, as before."""
    async def scenario():
        h = _rendering_harness(RenderingLLM(fail=True))
        h.core.submit("g", ["ok", "bad", "ok"], [BLOCK] * 3)
        await _reported(h, 3)
        return h

    h = asyncio.run(scenario())
    assert [e[2] for e in h.llm.events if e[0] == "add"] == ["ok", "bad", "ok"]  # raw prompts
    got = h.by_id()
    assert got["g-1"].error is not None and "prompt must be a string" in str(got["g-1"].error)
    assert got["g-0"].error is None and got["g-2"].error is None


def test_the_engine_dying_while_a_batch_renders_reports_each_request_once():
    async def scenario():
        hold = threading.Event()
        h = _rendering_harness(RenderingLLM(hold=hold))
        h.core.submit("g", ["ok", "ok"], [None] * 2)
        await _settle()
        await h.core.fail(EngineDeadError("the engine is dead: rank pp0.tp0 died"))
        await _settle()
        hold.set()  # the render thread returns (to nothing: its call was cancelled)
        return h

    h = asyncio.run(scenario())
    got = h.by_id()  # asserts nothing was reported twice
    assert sorted(got) == ["g-0", "g-1"] and all("rank pp0.tp0" in str(r.error) for r in got.values())
    assert not [e for e in h.llm.events if e[0] == "add"]
