"""Collection with fakes (no Ray, no vLLM engine): a step's ends share one stash collective, and the ranks
get ``RequestOutput``s only for blocks parked on ``tracer.result`` (issue 53).

vLLM's output handler hands a step's outputs to their requests in chunks of
``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` with a loop turn between chunks; the engine
actor must still collect all of them with one ``nnsight_ray_stash``.
"""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

from nnsight_ray._internal.engine.core import EngineCore, Report
from nnsight_ray._internal.ranks.rpcs import RankRPCMixin

BLOCK = SimpleNamespace(extra_args={"nnsight_mediator": b"block"})


class ChunkedLLM:
    """Every request ends at the same step; its outputs are handed over in chunks, a loop turn apart."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.ends: dict[str, asyncio.Event] = {}
        self.rpcs: list[tuple] = []

    async def generate(self, prompt, param, request_id, lora_request=None):
        end = self.ends.setdefault(request_id, asyncio.Event())
        await end.wait()
        yield SimpleNamespace(finished=True, request_id=request_id)

    async def step(self) -> None:
        """vLLM's ``output_handler``: one step's outputs, ``chunk`` at a time, ``sleep(0)`` between."""
        ids = sorted(self.ends, key=lambda rid: int(rid.rsplit("-", 1)[1]))
        for start in range(0, len(ids), self.chunk):
            for rid in ids[start:start + self.chunk]:
                self.ends[rid].set()
            if start + self.chunk < len(ids):
                await asyncio.sleep(0)

    async def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        await asyncio.sleep(0.001)  # a round trip: later ends arrive meanwhile
        return [0]


async def _turns(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _run(chunk: int, prompts: int, steps: int = 1) -> tuple[ChunkedLLM, list[Report]]:
    async def scenario():
        llm, reports = ChunkedLLM(chunk), []
        core = EngineCore(llm, reports.extend, lambda: asyncio.sleep(0, "dead"))
        for step in range(steps):
            core.submit(f"g{step}", ["p"] * prompts, [BLOCK] * prompts)
            await _turns()
            await llm.step()
            await asyncio.sleep(0.05)
        return llm, reports

    return asyncio.run(scenario())


def test_a_steps_ends_handed_over_in_chunks_share_one_stash_collective():
    llm, reports = _run(chunk=128, prompts=300)
    stashes = [args for method, args in llm.rpcs if method == "nnsight_ray_stash"]
    assert len(stashes) == 1 and len(stashes[0][0]) == 300
    assert sorted(r.request_id for r in reports) == sorted(f"g0-{i}" for i in range(300))
    assert all(r.error is None and r.output.finished for r in reports)


def test_ends_of_separate_steps_are_collected_apart():
    llm, reports = _run(chunk=128, prompts=4, steps=3)
    stashes = [sorted(args[0]) for method, args in llm.rpcs if method == "nnsight_ray_stash"]
    assert stashes == [[f"g{s}-{i}" for i in range(4)] for s in range(3)]
    assert len(reports) == 12


class DeferringLLM(ChunkedLLM):
    """Its ranks answer the first stash with the requests whose blocks are parked on ``tracer.result``."""

    def __init__(self, parked: list[list[str]]) -> None:
        super().__init__(chunk=128)
        self.parked = parked  # per rank

    async def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        return [list(p) for p in self.parked] if args[2] == "defer" else [[] for _ in self.parked]


def _deferring(parked: list[list[str]]) -> list[tuple]:
    async def scenario():
        llm = DeferringLLM(parked)
        core = EngineCore(llm, lambda reports: None, lambda: asyncio.sleep(0, "dead"))
        core.submit("g", ["p"] * 4, [BLOCK] * 4)
        await _turns()
        await llm.step()
        await asyncio.sleep(0.05)
        return llm.rpcs

    return asyncio.run(scenario())


def test_outputs_go_to_the_ranks_only_for_blocks_parked_on_the_result():
    calls = _deferring([[], []])
    assert [(sorted(a[0]), a[1], a[2]) for _, a in calls] == [([f"g-{i}" for i in range(4)], None, "defer")]
    calls = _deferring([["g-1"], ["g-1", "g-3"]])  # the union of what the ranks deferred
    assert len(calls) == 2 and calls[1][1][0] == ["g-1", "g-3"] and calls[1][1][2] == "results"
    sent = pickle.loads(calls[1][1][1])
    assert sorted(sent) == ["g-1", "g-3"] and all(o.finished for o in sent.values())


class FakeMediator:
    def __init__(self, provider: str | None, alive: bool = True) -> None:
        self.pending = SimpleNamespace(provider=provider) if provider else None
        self.alive = alive


class FakeRank(RankRPCMixin):
    """A rank's ``collect_nnsight`` over nnsight's ``Request``s; records what each call collected and served."""

    def __init__(self, providers: dict[str, str | None]) -> None:
        from nnsight.modeling.vllm.model_runners.GPUModelRunner import Request

        self.requests = {}
        for rid, provider in providers.items():
            request = Request(f"{rid}-0123abcd")  # vLLM's suffixed id
            request.mediator = FakeMediator(provider)
            self.requests[request.id] = request
        self.model_runner = SimpleNamespace(nnsight_requests=SimpleNamespace(requests=self.requests))
        self.calls: list[tuple[list[str], list[str]]] = []

    def collect_nnsight(self, request_ids, finished_ids, outputs):
        self.calls.append((list(request_ids), sorted(outputs or {})))
        return {rid: {"saves": {"x": rid}, "error": None, "registered": {}, "sequences": {}} for rid in request_ids}


def test_a_rank_defers_only_blocks_parked_on_the_result_and_collects_them_with_their_outputs(monkeypatch):
    from nnsight_ray._internal.ranks import rpcs

    monkeypatch.setattr(rpcs, "_stash", type(rpcs._stash)())
    rank = FakeRank({"g-0": "model.layers.0.output", "g-1": "result", "g-2": None, "h-0": "result"})
    deferred = rank.nnsight_ray_stash(["g-0", "g-1", "g-2"], None, "defer")
    assert deferred == ["g-1"]  # h-0 is parked on its result too, but was not asked about
    assert rank.calls == [(["g-0", "g-2"], [])]
    assert sorted(rpcs._stash) == ["g-0", "g-2"]
    outputs = pickle.dumps({"g-1": "output of g-1"})
    # the second call names the union of every rank's deferrals: this rank collects only its own
    assert rank.nnsight_ray_stash(["g-1", "g-2"], outputs, "results") == []
    assert rank.calls[1] == (["g-1"], ["g-1"])
    assert rpcs.stash_take(["g-0", "g-1", "g-2"]) == [
        {"saves": {"x": rid}, "error": None, "registered": {}, "sequences": {}} for rid in ("g-0", "g-1", "g-2")]
    # the engine's former call (every request, outputs with it) still collects all
    assert rank.nnsight_ray_stash(["h-0"], pickle.dumps({"h-0": 1})) == [] and rank.calls[2] == (["h-0"], ["h-0"])


def _waves(waves: list[list[int]], params: list, park_max: int | None = None, monkeypatch=None):
    """One call of ``len(params)`` requests whose ends come in ``waves`` (request indices), a step apart."""
    from nnsight_ray._internal.engine import core as engine_core

    if park_max is not None:
        monkeypatch.setattr(engine_core, "PARK_MAX", park_max)

    async def scenario():
        llm, handed = ChunkedLLM(chunk=128), []
        core = EngineCore(llm, lambda reports: handed.append(sorted(r.request_id for r in reports)),
                          lambda: asyncio.sleep(0, "dead"))
        core.submit("g", ["p"] * len(params), params)
        await _turns()
        for wave in waves:
            for i in wave:
                llm.ends[f"g-{i}"].set()
            await asyncio.sleep(0.02)  # a step
        return [sorted(a[0]) for m, a in llm.rpcs if m == "nnsight_ray_stash"], handed

    return asyncio.run(scenario())


def test_a_calls_requests_ending_over_several_steps_are_collected_once_at_its_last_end():
    stashes, handed = _waves([[0, 1], [2], [3, 4]], [BLOCK] * 5)
    assert stashes == [[f"g-{i}" for i in range(5)]] and handed == [[f"g-{i}" for i in range(5)]]


def test_plain_requests_are_handed_over_as_they_end_and_parking_is_capped(monkeypatch):
    plain = SimpleNamespace(extra_args=None)
    stashes, handed = _waves([[0, 1], [2, 3]], [plain, BLOCK, plain, BLOCK])
    assert stashes == [["g-1", "g-3"]] and handed == [["g-0"], ["g-1", "g-2", "g-3"]]
    stashes, _ = _waves([[0], [1], [2], [3], [4]], [BLOCK] * 5, park_max=2, monkeypatch=monkeypatch)
    assert stashes == [["g-0", "g-1", "g-2"], ["g-3", "g-4"]]
    stashes, _ = _waves([[0], [1], [2]], [BLOCK] * 3, park_max=0, monkeypatch=monkeypatch)
    assert stashes == [["g-0"], ["g-1"], ["g-2"]]  # as before issue 53
