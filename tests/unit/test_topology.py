"""Rank identities and CPU binding plans: pure logic, no Ray, no engine."""

from __future__ import annotations

import pytest

from nnsight_ray._internal.cluster.topology import RankId, cpu_binding_plan


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("unit tests must not start or join Ray")

    monkeypatch.setattr(ray, "init", refuse)


# --- RankId -----------------------------------------------------------------


@pytest.mark.parametrize(
    "rank",
    [
        RankId("engine", 0, 0),
        RankId("engine", 1, 3),
        RankId("my.dotted.engine", 2, 0),  # the engine part may itself contain dots
        RankId("a1b2c3-instance", 10, 12),
    ],
)
def test_actor_name_round_trip(rank):
    name = rank.actor_name
    assert name == f"{rank.engine}.pp{rank.pp}.tp{rank.tp}"
    assert RankId.from_actor_name(name) == rank


def test_rank_ids_sort_by_engine_then_pp_then_tp():
    ranks = [RankId("e", 1, 0), RankId("e", 0, 1), RankId("e", 0, 0), RankId("d", 5, 5)]
    assert sorted(ranks) == [RankId("d", 5, 5), RankId("e", 0, 0), RankId("e", 0, 1), RankId("e", 1, 0)]


def test_rank_id_is_hashable_and_frozen():
    rank = RankId("e", 0, 1)
    assert {rank: 1}[RankId("e", 0, 1)] == 1
    with pytest.raises(AttributeError):
        rank.pp = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "name",
    [
        "engine",  # no coordinates
        "engine.pp0",  # tp missing
        "engine.tp0.pp1",  # swapped
        "engine.px0.tp1",
        "engine.pp0.tx1",
        "engine.ppx.tp0",  # not a number
        "engine.pp.tp0",  # empty number
        "engine.pp0.tp",
        "",
    ],
)
def test_bad_actor_names_rejected(name):
    with pytest.raises(ValueError):
        RankId.from_actor_name(name)


@pytest.mark.parametrize("name", [".pp0.tp0", "engine.pp-1.tp0", "engine.pp0.tp+1"])
def test_degenerate_actor_names_rejected(name):
    with pytest.raises(ValueError):
        RankId.from_actor_name(name)


# --- cpu_binding_plan -------------------------------------------------------


def host(ip: str, cpus) -> dict:
    return {"ip": ip, "cpus": list(cpus)}


def test_auto_splits_a_hosts_cores_among_its_ranks():
    hosts = [host("10.0.0.1", range(4))] * 2
    assert cpu_binding_plan(hosts, "auto") == [[0, 1], [2, 3]]


def test_auto_single_rank_gets_all_cores():
    assert cpu_binding_plan([host("10.0.0.1", [0, 1])], "auto") == [[0, 1]]


def test_auto_uneven_split_gives_each_rank_a_disjoint_share():
    # The remainder goes to the last ranks: no core idles.
    plan = cpu_binding_plan([host("h", range(5))] * 2, "auto")
    assert plan == [[0, 1], [2, 3, 4]]
    plan = cpu_binding_plan([host("h", range(4))] * 3, "auto")
    assert [len(cpus) for cpus in plan] == [1, 1, 2]
    assert len({c for cpus in plan for c in cpus}) == 4  # disjoint, all used


def test_auto_sorts_and_dedupes_reported_cpus():
    hosts = [host("h", [3, 1, 2, 0, 1])] * 2
    assert cpu_binding_plan(hosts, "auto") == [[0, 1], [2, 3]]


def test_auto_more_ranks_than_cores_share_round_robin():
    hosts = [host("h", [0, 1])] * 5
    assert cpu_binding_plan(hosts, "auto") == [[0], [1], [0], [1], [0]]


def test_auto_ranks_on_different_hosts_each_get_their_hosts_cores():
    hosts = [host("10.0.0.1", [0, 1]), host("10.0.0.2", [0, 1, 2, 3])]
    assert cpu_binding_plan(hosts, "auto") == [[0, 1], [0, 1, 2, 3]]


def test_auto_groups_by_ip_across_interleaved_ranks():
    # Ranks 0 and 2 share host A, rank 1 is alone on B, rank 3 alone on C.
    a, b, c = host("A", [0, 1, 2, 3]), host("B", [0, 1]), host("C", [4, 5])
    assert cpu_binding_plan([a, b, a, c], "auto") == [[0, 1], [0, 1], [2, 3], [4, 5]]


def test_nobind_leaves_every_rank_alone():
    hosts = [host("h", [0, 1])] * 3
    assert cpu_binding_plan(hosts, "nobind") == [[], [], []]


def test_explicit_lists_one_per_rank():
    hosts = [host("h", [0, 1])] * 2
    assert cpu_binding_plan(hosts, "0|1") == [[0], [1]]
    assert cpu_binding_plan(hosts, "0-1|2,3") == [[0, 1], [2, 3]]


@pytest.mark.parametrize("binding", ["0", "0|1|2"])
def test_explicit_lists_wrong_count_is_an_error(binding):
    hosts = [host("h", [0, 1])] * 2
    with pytest.raises(ValueError, match=r"CPU lists for 2 ranks"):
        cpu_binding_plan(hosts, binding)
