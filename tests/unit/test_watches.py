"""The actors' logic classes with fakes (no Ray): ``liveness.DeathWatch`` (the engine actor's),
``liveness.EngineWatch`` (a merge actor's), ``placement.RankReservation``, ``engine.core.engine_args``.

The GCS actor table is a dict, the node list a set, vLLM's engine-core
processes ``SimpleNamespace(pid, exitcode)``, the engine actor's ping a
coroutine; retries sleep no time. The messages asserted are the ones the
integration kill tests see.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nnsight_ray._internal.cluster.liveness import (ENGINE, MERGE, RANK, ActorRecord, Cluster, DeathWatch, DeploymentRecords,
                                            EngineWatch, engine_dead)
from nnsight_ray._internal.merge.book import MergeBook
from nnsight_ray.errors import EngineDeadError

ENGINE_RECORD = ActorRecord(ENGINE, "e.engine", "E", "n0", 11)
MERGE_RECORD = ActorRecord(MERGE, "e.merge0", "M")
RANK0 = ActorRecord(RANK, "e.pp0.tp0", "R0", "n1", label="rank pp0.tp0")
RANK1 = ActorRecord(RANK, "e.pp0.tp1", "R1", "n2", label="rank pp0.tp1")
RECORDS = DeploymentRecords(ENGINE_RECORD, [MERGE_RECORD], [RANK0, RANK1])


def _entry(state: str, node: str, end_ms: float = 0.0, cause: str = "") -> dict:
    entry = {"State": state, "Address": {"NodeID": node}, "EndTime": end_ms}
    if cause:
        entry["DeathCause"] = SimpleNamespace(actor_died_error_context=SimpleNamespace(error_message=cause))
    return entry


def _alive_table() -> dict:
    return {"E": _entry("ALIVE", "n0"), "M": _entry("ALIVE", "n0"), "R0": _entry("ALIVE", "n1"),
            "R1": _entry("ALIVE", "n2")}


async def _no_sleep(seconds: float) -> None:
    _no_sleep.slept.append(seconds)


async def _inline(read):
    return read()


def _cluster(table: dict, nodes: set[str] | None = None) -> Cluster:
    _no_sleep.slept = []
    return Cluster(table.get, lambda: set(nodes if nodes is not None else {"n0", "n1", "n2"}),
                   offload=_inline, sleep=_no_sleep)


class FakeCore:
    """``EngineCore``'s surface a ``DeathWatch`` uses."""

    def __init__(self, errored: bool = False) -> None:
        self.dead = None
        self.llm = SimpleNamespace(errored=errored)
        self.collect_stats = {"calls": 2, "requests": 3, "seconds": 0.5, "max_s": 0.3}

    async def fail(self, error: EngineDeadError) -> None:
        self.dead = error


# -- DeathWatch: the engine actor's -------------------------------------------


def test_death_watch_survey_has_the_engine_alive_and_reads_the_others():
    table = _alive_table()
    table["R1"] = _entry("DEAD", "n2", 5)
    states = DeathWatch(RECORDS, _cluster(table)).survey()
    assert [(s.record.name, s.state) for s in states] == [
        ("e.engine", "ALIVE"), ("e.merge0", "ALIVE"), ("e.pp0.tp0", "ALIVE"), ("e.pp0.tp1", "DEAD")]


def test_death_watch_check_fails_the_core_with_the_first_rank_to_die():
    table = _alive_table()
    table["R0"], table["R1"] = _entry("DEAD", "n1", 2000), _entry("DEAD", "n2", 1000)
    core = FakeCore()
    watch = DeathWatch(RECORDS, _cluster(table, {"n0", "n1"}))
    assert asyncio.run(watch.check(core)) is True
    assert isinstance(core.dead, EngineDeadError)
    assert str(core.dead) == engine_dead("rank pp0.tp1 (actor e.pp0.tp1) on node n2 (node removed) died")
    assert asyncio.run(watch.check(core)) is True  # dead: the watch ends
    assert asyncio.run(watch.check(None)) is False  # not started yet: keep watching


def test_death_watch_check_leaves_a_live_deployment_alone():
    core = FakeCore()
    assert asyncio.run(DeathWatch(RECORDS, _cluster(_alive_table())).check(core)) is False
    assert core.dead is None


def test_the_node_table_is_read_only_once_an_actor_is_dead():
    """A watch step reads each actor's entry; the node table (``ray.nodes()``) only places a death."""
    reads = []
    table = _alive_table()

    def nodes():
        reads.append(1)
        return {"n0", "n1"}

    watch = DeathWatch(RECORDS, Cluster(table.get, nodes, offload=_inline, sleep=_no_sleep))
    assert asyncio.run(watch.check(FakeCore())) is False and reads == []
    table["R1"] = _entry("DEAD", "n2", 5)
    core = FakeCore()
    assert asyncio.run(watch.check(core)) is True and reads == [1]
    assert "on node n2 (node removed)" in str(core.dead)


def test_a_dead_merge_actor_is_named_by_the_engine_watch():
    table = _alive_table()
    table["M"] = _entry("DEAD", "n0", 7)
    core = FakeCore()
    asyncio.run(DeathWatch(RECORDS, _cluster(table)).check(core))
    assert str(core.dead) == engine_dead("merge actor e.merge0 on node n0 (node alive) died")


def test_an_ended_engine_core_process_is_blamed_over_the_ranks_it_took_with_it():
    table = _alive_table()
    table["R0"] = _entry("DEAD", "n1", 3, cause="The actor is dead because its owner has died.")
    processes = [SimpleNamespace(pid=77, exitcode=-9)]
    watch = DeathWatch(RECORDS, _cluster(table), lambda: processes)
    assert watch.core_process() == ("vLLM's engine core process (pid 77) of engine actor e.engine on node n0 "
                                    "exited with code -9")
    core = FakeCore()
    asyncio.run(watch.check(core))
    assert str(core.dead) == engine_dead(watch.core_process())
    assert DeathWatch(RECORDS, _cluster(table), lambda: [SimpleNamespace(pid=77, exitcode=None)]).core_process() is None


def test_describe_dead_retries_the_gcs_then_says_every_actor_was_alive():
    """vLLM said the engine died, the GCS names nobody: five looks, a second apart, then the plain message."""
    looks = []
    table = _alive_table()

    def entry(actor_id):
        looks.append(actor_id)
        return table.get(actor_id)

    cluster = _cluster(table)
    watch = DeathWatch(RECORDS, Cluster(entry, cluster.alive_nodes, offload=_inline, sleep=_no_sleep))
    message = asyncio.run(watch.describe_dead())
    assert message == engine_dead("vLLM's engine core in engine actor e.engine on node n0 failed with every "
                                  "actor alive (see the engine actor's log)")
    attempts = DeathWatch.DESCRIBE_ATTEMPTS
    assert attempts * DeathWatch.DESCRIBE_RETRY_S > DeathWatch.KILL_GRACE_S  # a held-back kill is still named
    assert _no_sleep.slept == [1.0] * attempts and len(looks) == attempts * len(RECORDS.others())


def test_describe_dead_finds_a_death_the_gcs_learns_of_late():
    table = _alive_table()
    cluster = _cluster(table)

    async def sleep(seconds):
        table["R1"] = _entry("DEAD", "n2", 4)

    watch = DeathWatch(RECORDS, Cluster(table.get, cluster.alive_nodes, offload=_inline, sleep=sleep))
    assert "rank pp0.tp1 (actor e.pp0.tp1) on node n2 (node alive) died" in asyncio.run(watch.describe_dead())


def test_an_errored_vllm_with_every_actor_alive_fails_the_core_after_the_retries():
    core = FakeCore(errored=True)
    assert asyncio.run(DeathWatch(RECORDS, _cluster(_alive_table())).check(core)) is True
    assert "failed with every actor alive" in str(core.dead)


def test_health_lists_every_actor_and_the_core_processes():
    table = _alive_table()
    processes = [SimpleNamespace(pid=77, exitcode=None)]
    watch = DeathWatch(RECORDS, _cluster(table), lambda: processes)
    health = asyncio.run(watch.health(FakeCore(), 12.5))
    assert health["alive"] is True and health["error"] is None and health["uptime_s"] == 12.5
    assert health["core_pids"] == [77] and health["collect"]["calls"] == 2
    assert [a["name"] for a in health["actors"]] == ["e.engine", "e.merge0", "e.pp0.tp0", "e.pp0.tp1"]
    table["R0"] = _entry("DEAD", "n1", 9)
    dead = asyncio.run(watch.health(FakeCore(), 13.0))
    assert dead["alive"] is False and "rank pp0.tp0 (actor e.pp0.tp0)" in dead["error"]
    assert [a["state"] for a in dead["actors"]] == ["ALIVE", "ALIVE", "DEAD", "ALIVE"]


# -- EngineWatch: a merge actor's ---------------------------------------------


class Died(Exception):
    """Stands in for Ray's ``RayActorError``."""


def _engine_watch(table: dict, declared_wait_s: float = 0.05) -> tuple[EngineWatch, MergeBook]:
    book = MergeBook(abandon_after_s=10, ttl_s=60)
    watch = EngineWatch("e.merge0", book, _cluster(table), (Died,), ping_timeout_s=0.2,
                        declared_wait_s=declared_wait_s)
    watch.watch([RANK0, RANK1], ENGINE_RECORD)
    return watch, book


def test_a_dead_engine_actor_fails_every_waiter_with_its_name():
    table = _alive_table()
    table["E"] = _entry("DEAD", "n0", 3)

    async def scenario():
        watch, book = _engine_watch(table)
        waiting = asyncio.ensure_future(book.wait("g", 1))
        await asyncio.sleep(0)

        async def ping():
            raise Died("actor gone")

        assert await watch.engine_gone(ping) is True
        state = await asyncio.wait_for(waiting, 1)
        assert isinstance(state.error, EngineDeadError)
        assert await watch.engine_gone(ping) is True  # already dead: no second look
        with pytest.raises(EngineDeadError, match="engine actor e.engine"):  # so is every later wait
            await book.wait("later", 1)
        return str(state.error)

    assert asyncio.run(scenario()) == engine_dead("engine actor e.engine on node n0 (node alive) died")


def test_an_engine_actor_the_gcs_does_not_know_dead_is_named_from_its_record():
    async def scenario():
        watch, book = _engine_watch({})

        async def ping():
            raise Died("actor gone")

        await watch.engine_gone(ping)
        return book.dead

    assert asyncio.run(scenario()) == engine_dead("engine actor e.engine on node n0 died (Died)")


def test_a_slow_or_live_engine_actor_is_not_a_death():
    async def scenario():
        watch, book = _engine_watch(_alive_table())

        async def slow():
            await asyncio.sleep(5)

        async def answers():
            return True

        return await watch.engine_gone(slow), await watch.engine_gone(answers), book.dead

    assert asyncio.run(scenario()) == (False, False, None)


def test_a_rank_failure_seen_first_takes_the_engines_declared_message():
    async def scenario():
        watch, book = _engine_watch(_alive_table(), declared_wait_s=5)
        asking = asyncio.ensure_future(watch.death_message("rank actor e.pp0.tp0 could not hand over its saves"))
        await asyncio.sleep(0)
        watch.fail("the engine is dead: rank pp0.tp1 died")
        return await asyncio.wait_for(asking, 1)

    assert asyncio.run(scenario()) == "the engine is dead: rank pp0.tp1 died"


def test_without_a_declaration_the_first_dead_in_the_gcs_is_named_or_what_was_seen():
    table = _alive_table()
    table["R1"] = _entry("DEAD", "n2", 4)
    watch, _ = _engine_watch(table)
    what = "rank actor e.pp0.tp0 could not hand over its saves (RayActorError: x)"
    assert asyncio.run(watch.death_message(what)) == engine_dead(
        "rank pp0.tp1 (actor e.pp0.tp1) on node n2 (node alive) died")
    watch, _ = _engine_watch(_alive_table())
    assert asyncio.run(watch.death_message(what)) == engine_dead(what)


def test_cluster_actor_died_without_a_record():
    assert _cluster({}).actor_died(None, Died("boom")) == engine_dead("an actor of the deployment died (boom)")


# -- RankReservation ----------------------------------------------------------


class FakeGroups:
    """``ray.util.placement_group_table`` and ``remove_placement_group`` over a dict of states."""

    def __init__(self, groups: dict[str, dict]) -> None:
        self.groups = groups
        self.removed: list[str] = []

    def table(self, pg=None):
        if pg is None:
            return {k: dict(v) for k, v in self.groups.items()}
        return dict(self.groups.get(pg.id.hex(), {"state": "REMOVED"}))

    def remove(self, pg):
        self.removed.append(pg.id.hex())
        self.groups[pg.id.hex()]["state"] = "REMOVED"


@pytest.fixture
def groups(monkeypatch):
    import importlib

    import ray

    pg_module = importlib.import_module("ray.util.placement_group")  # the attribute is the function
    fake = FakeGroups({})
    monkeypatch.setattr(ray.util, "placement_group_table", fake.table)
    monkeypatch.setattr(pg_module, "remove_placement_group", fake.remove)
    return fake


def _hex(n: int) -> str:
    return f"{n:02x}" * 18  # a placement group id is 18 bytes


def test_release_removes_an_owned_live_group_once(groups):
    from nnsight_ray._internal.cluster.placement import RankReservation

    groups.groups[_hex(1)] = {"name": "e.ranks", "state": "CREATED"}
    mine = RankReservation(_hex(1), owned=True)
    assert mine.release() is True
    assert mine.release() is False and RankReservation(_hex(1), owned=True).release() is False
    assert groups.removed == [_hex(1)]


def test_release_never_removes_the_callers_group(groups):
    from nnsight_ray._internal.cluster.placement import RankReservation

    groups.groups[_hex(2)] = {"name": "theirs", "state": "CREATED"}
    assert RankReservation(_hex(2), owned=False).release() is False
    assert groups.removed == []


def test_reclaim_removes_every_live_group_of_the_name(groups):
    from nnsight_ray._internal.cluster.placement import RankReservation

    groups.groups.update({_hex(1): {"name": "e.ranks", "state": "CREATED"},
                          _hex(2): {"name": "e.ranks", "state": "REMOVED"},
                          _hex(3): {"name": "other.ranks", "state": "CREATED"},
                          _hex(4): {"name": "e.ranks", "state": "PENDING"}})
    assert RankReservation.reclaim("e.ranks") == 2
    assert sorted(groups.removed) == [_hex(1), _hex(4)]
    assert RankReservation.reclaim("e.ranks") == 0


def test_a_plan_says_whose_group_it_is():
    from nnsight_ray._internal.cluster.placement import PlacementPlan, RankPlacement, RankReservation

    plan = PlacementPlan(placement=RankPlacement(device="cpu"), world_size=2, placement_group_id=_hex(5),
                         owns_placement_group=True)
    assert RankReservation.of(plan) == RankReservation(_hex(5), owned=True)


def test_a_placement_group_handle_from_its_hex_id_uses_rays_public_id():
    from nnsight_ray._internal.cluster.placement import placement_group_by_id

    assert placement_group_by_id(_hex(6)).id.hex() == _hex(6)


# -- the engine actor's start-up ------------------------------------------------


def test_engine_args_keep_the_users_settings_and_add_nnsights():
    from nnsight_ray._internal.deploy import DeploymentSpec
    from nnsight_ray._internal.engine.core import engine_args
    from nnsight_ray._internal.cluster.placement import ADDITIONAL_CONFIG_KEY, PlacementPlan, RankPlacement

    plan = PlacementPlan(placement=RankPlacement(device="cpu"), world_size=1, placement_group_id=_hex(7))
    spec = DeploymentSpec(name="e", model="/models/tiny", engine_kwargs={"max_model_len": 64,
                          "enable_prefix_caching": True}, placement=plan, merge_names=("e.merge0",))
    args, changed = engine_args(spec)
    assert args["model"] == "/models/tiny" and args["enforce_eager"] is True
    assert args["disable_log_stats"] is True  # vllm.LLM's default (usage context LLM_CLASS)
    assert [c.split("=")[0] for c in changed] == ["enable_chunked_prefill", "enforce_eager"]  # the user set the third
    assert args["max_model_len"] == 64 and args["enable_prefix_caching"] is True
    assert args["enable_chunked_prefill"] is False
    assert args["worker_cls"] == "nnsight_ray._internal.ranks.worker.NNsightWorker"
    assert PlacementPlan.model_validate(args["additional_config"][ADDITIONAL_CONFIG_KEY]) == plan
    assert spec.engine_kwargs == {"max_model_len": 64, "enable_prefix_caching": True}  # not changed
    assert spec.engine_name == "e.engine"


# -- who is blamed when vLLM's executor ray.kills the survivors -----------------

KILLED_CAUSE = "The actor is dead because it was killed by `ray.kill`."


def test_a_rank_on_a_lost_node_is_blamed_over_the_survivors_vllm_killed_first():
    """The CI finding: vLLM ray.killed pp0.tp0 (n1, alive) before the GCS marked pp0.tp1's node (n2) dead."""
    table = _alive_table()
    table["R0"] = _entry("DEAD", "n1", 1000, cause=KILLED_CAUSE)
    table["R1"] = _entry("DEAD", "n2", 3000, cause="The actor died because its node has died.")
    core = FakeCore()
    asyncio.run(DeathWatch(RECORDS, _cluster(table, {"n0", "n1"})).check(core))
    assert str(core.dead) == engine_dead("rank pp0.tp1 (actor e.pp0.tp1) on node n2 (node removed) died "
                                         "(The actor died because its node has died.)")


def test_a_death_of_another_cause_is_blamed_over_earlier_ray_kills():
    table = _alive_table()
    table["R0"] = _entry("DEAD", "n1", 1000, cause=KILLED_CAUSE)
    table["R1"] = _entry("DEAD", "n2", 2000, cause="The actor died unexpectedly: worker process exited (SIGSEGV).")
    core = FakeCore()
    asyncio.run(DeathWatch(RECORDS, _cluster(table)).check(core))
    assert "e.pp0.tp1" in str(core.dead) and "SIGSEGV" in str(core.dead)


def test_a_killed_engine_actor_is_blamed_over_the_ranks_that_died_with_it():
    """The CI finding (tp2pp2): the ranks' end times came before the killed engine actor's; a merge
    actor's watch named rank pp0.tp0 ("its owner has died") instead of the engine actor."""
    table = _alive_table()
    table["R0"] = _entry("DEAD", "n1", 1000, cause="The actor is dead because its owner has died.")
    table["E"] = _entry("DEAD", "n0", 1500, cause=KILLED_CAUSE)
    watch, _ = _engine_watch(table)
    message = asyncio.run(watch.death_message("rank actor e.pp0.tp0 could not hand over its saves"))
    assert message == engine_dead(f"engine actor e.engine on node n0 (node alive) died ({KILLED_CAUSE})")


TORN_DOWN_CAUSE = ("The actor is dead because its worker process has died. Worker exit type: INTENDED_SYSTEM_EXIT "
                   "Worker exit detail: Destroying worker since its placement group was removed.")


def _named_after_the_grace(deaths: dict) -> str:
    """The engine-dead message a rank watch gives for ``deaths`` (GCS entries by record), which it holds back
    for the kill grace first."""
    table = _alive_table()
    table.update(deaths)
    now = [100.0]
    watch = DeathWatch(RECORDS, _cluster(table), clock=lambda: now[0])
    core = FakeCore()
    assert asyncio.run(watch.check(core)) is False and core.dead is None
    now[0] += DeathWatch.KILL_GRACE_S - 0.1
    assert asyncio.run(watch.check(core)) is False
    now[0] += 0.2
    assert asyncio.run(watch.check(core)) is True
    return str(core.dead)


def test_a_killed_rank_is_blamed_over_the_ranks_destroyed_with_its_placement_group():
    """Found by CI (tp2pp2): a user ray.killed pp0.tp1; the deployment, taken down after it,
    removed its placement group, which destroyed pp0.tp0 (here); the GCS showed both within the grace, and
    the survivor's cause was named as the deployment's own."""
    message = _named_after_the_grace({"R1": _entry("DEAD", "n2", 1000, cause=KILLED_CAUSE),
                                      "R0": _entry("DEAD", "n1", 1200, cause=TORN_DOWN_CAUSE)})
    assert "e.pp0.tp1" in message and "killed by `ray.kill`" in message
    # a placement group removed while every other actor lives is named, after the grace, with its cause
    message = _named_after_the_grace({"R0": _entry("DEAD", "n1", 1200, cause=TORN_DOWN_CAUSE)})
    assert "e.pp0.tp0" in message and "placement group was removed" in message


def test_kill_only_deaths_are_held_back_for_the_grace_then_the_first_is_named():
    """Only ray.kills on live nodes: a lost node may still be found; a user's own kill is named after the grace."""
    message = _named_after_the_grace({"R1": _entry("DEAD", "n2", 2000, cause=KILLED_CAUSE),
                                      "R0": _entry("DEAD", "n1", 1000, cause=KILLED_CAUSE)})
    assert "e.pp0.tp0" in message and "killed by `ray.kill`" in message


def test_a_node_lost_during_the_grace_is_named_at_once():
    table = _alive_table()
    table["R0"] = _entry("DEAD", "n1", 1000, cause=KILLED_CAUSE)
    table["R1"] = _entry("DEAD", "n2", 1001, cause=KILLED_CAUSE)
    nodes = {"n0", "n1", "n2"}
    watch = DeathWatch(RECORDS, Cluster(table.get, lambda: set(nodes), offload=_inline, sleep=_no_sleep),
                       clock=lambda: 0.0)
    core = FakeCore()
    assert asyncio.run(watch.check(core)) is False
    nodes.discard("n2")  # the GCS's health check found it
    assert asyncio.run(watch.check(core)) is True
    assert "e.pp0.tp1" in str(core.dead) and "(node removed)" in str(core.dead)


def test_a_killed_merge_actor_is_named_at_once_and_health_never_says_alive_over_a_dead_actor():
    table = _alive_table()
    table["M"] = _entry("DEAD", "n0", 1000, cause=KILLED_CAUSE)
    core = FakeCore()
    assert asyncio.run(DeathWatch(RECORDS, _cluster(table), clock=lambda: 0.0).check(core)) is True  # no grace
    assert "e.merge0" in str(core.dead)
    table = _alive_table()
    table["R0"] = _entry("DEAD", "n1", 1000, cause=KILLED_CAUSE)  # a rank kill, held back
    health = asyncio.run(DeathWatch(RECORDS, _cluster(table), clock=lambda: 0.0).health(FakeCore(), 1.0))
    assert health["alive"] is False and "e.pp0.tp0" in health["error"]
