"""Envoys travel by reference (``_internal.envoy_refs``): on nnsight's real pickler and two real meta trees."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """Two meta-only clients of one tiny checkpoint: the "client" and the "rank" side."""
    from nnsight_ray import LocalVLLM
    from nnsight_ray.models import build_model

    path = str(build_model(tmp_path_factory.mktemp("envoy-refs-llama"), arch="llama", seed=0))
    return LocalVLLM(path), LocalVLLM(path)


def rank_objects(rank):
    from nnsight_ray._internal.blocks.envoy_refs import envoy_objects

    return {**rank._remoteable_persistent_objects(), **envoy_objects(rank)}


def test_a_block_names_the_rank_envoys_and_is_a_fraction_of_the_size(trees):
    from nnsight.intervention.serialization import dumps, loads

    from nnsight_ray._internal.blocks.envoy_refs import by_reference

    client, rank = trees
    held = {"model": client, "layer": client.model.layers[2], "n": 3}
    by_value = dumps(held)
    with by_reference(client):
        by_ref = dumps(held)
    assert len(by_ref) * 10 < len(by_value), (len(by_ref), len(by_value))
    got = loads(by_ref, rank_objects(rank))
    assert got["model"] is rank and got["layer"] is rank.model.layers[2] and got["n"] == 3
    # By value the rank rebuilds a tree of its own, over its own modules: same paths, same modules.
    copy = loads(by_value, rank_objects(rank))
    assert copy["layer"] is not rank.model.layers[2] and copy["layer"].path == rank.model.layers[2].path
    assert copy["layer"]._module is rank.model.layers[2]._module


def test_tags_exist_only_inside_and_never_under_another_threads_pickle(trees):
    from nnsight.intervention.serialization import dumps

    from nnsight_ray._internal.blocks.envoy_refs import by_reference

    client, _ = trees
    sizes, errors = [], []

    def attach():
        try:
            for _ in range(20):
                with by_reference(client):
                    sizes.append(len(dumps({"model": client})))
        except Exception as error:  # noqa: BLE001 - asserted below
            errors.append(error)

    threads = [threading.Thread(target=attach) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(sizes)) == 1  # every pickle referenced the tree
    assert not any("_persistent_id" in envoy.__dict__ for envoy in client.modules())
    assert len(dumps({"model": client})) > 10 * sizes[0]  # outside: nnsight's own by-value form (serve=, remote=)


def test_by_value_where_the_rank_tree_differs(trees):
    from nnsight_ray._internal.blocks.envoy_refs import same_tree_as_ranks

    client, _ = trees
    assert same_tree_as_ranks(client, 1)
    assert not same_tree_as_ranks(client, 2)  # a pipeline stage's tree lacks the other stages' submodules
    client.__dict__["_rename"] = {"layers": "h"}
    try:
        assert not same_tree_as_ranks(client, 1)  # aliases the rank's tree does not have
    finally:
        client.__dict__["_rename"] = None
    envoys = client.__dict__["_envoys"]
    client.__dict__["_envoys"] = {}
    try:
        assert not same_tree_as_ranks(client, 1)  # envoy classes of the user's own
    finally:
        client.__dict__["_envoys"] = envoys
