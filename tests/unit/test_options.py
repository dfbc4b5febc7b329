"""Ray placement options: splitting them off vLLM's kwargs, validating them, the plan that rides vLLM's config.

``configure_engine_kwargs`` is only called without ``distributed_executor_backend="ray"``:
with it, it connects to Ray, which a unit test must not do (``ray.init`` raises here).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nnsight_ray._internal.cluster.placement import (
    ADDITIONAL_CONFIG_KEY,
    RAY_OPTION_NAMES,
    PlacementPlan,
    RankPlacement,
    split_ray_options,
)
from nnsight_ray._internal.ranks.executor import configure_engine_kwargs, engine_kwargs_with


def test_split_separates_placement_options_from_engine_kwargs():
    kwargs = {
        "dtype": "float32",
        "max_model_len": 256,
        "placement_strategy": "SPREAD",
        "cpus_per_rank": 2,
        "placement_group": object(),
    }
    engine, ray_options = split_ray_options(kwargs)
    assert engine == {"dtype": "float32", "max_model_len": 256}
    assert set(ray_options) == {"placement_strategy", "cpus_per_rank", "placement_group"}
    assert kwargs["placement_strategy"] == "SPREAD"  # the input is not mutated


def test_split_without_placement_options():
    assert split_ray_options({"dtype": "float32"}) == ({"dtype": "float32"}, {})
    assert split_ray_options({}) == ({}, {})


def test_option_names_are_the_model_fields_plus_placement_group():
    assert RAY_OPTION_NAMES == set(RankPlacement.model_fields) | {"placement_group"}


def test_defaults():
    p = RankPlacement()
    assert p.placement_strategy == "PACK"
    assert p.cpu_binding == "auto"
    assert p.placement_group_id is None and p.ray_address is None
    # JSON-able: it rides VllmConfig.additional_config.
    import json

    assert RankPlacement(**json.loads(json.dumps(p.model_dump()))) == p


@pytest.mark.parametrize(("env", "expected"), [(None, True), ("1", True), ("on", True), ("0", False),
                                               ("false", False), ("OFF", False), ("no", False)])
def test_early_ranks_is_on_unless_the_environment_turns_it_off(monkeypatch, env, expected):
    """On the H200 a TP=1 engine starts in 62-66 s with it against 87-99 s without: the default."""
    from nnsight_ray._internal.cluster.placement import EARLY_RANKS_ENV

    if env is None:
        monkeypatch.delenv(EARLY_RANKS_ENV, raising=False)
    else:
        monkeypatch.setenv(EARLY_RANKS_ENV, env)
    assert RankPlacement().early_ranks is expected
    assert RankPlacement(early_ranks=not expected).early_ranks is (not expected)  # the keyword wins


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
def test_known_strategies_accepted(strategy):
    assert RankPlacement(placement_strategy=strategy).placement_strategy == strategy


@pytest.mark.parametrize("strategy", ["RANDOM", "pack", "", None])
def test_bad_strategy_rejected(strategy):
    with pytest.raises(ValidationError, match="placement_strategy"):
        RankPlacement(placement_strategy=strategy)


def test_unknown_key_rejected():
    with pytest.raises(ValidationError, match="placement_strtegy"):
        RankPlacement(placement_strtegy="SPREAD")


@pytest.mark.parametrize(
    "field, value",
    [("cpus_per_rank", -1), ("gpus_per_rank", -0.5), ("placement_timeout_s", 0), ("placement_timeout_s", -3)],
)
def test_bad_numbers_rejected(field, value):
    with pytest.raises(ValidationError, match=field):
        RankPlacement(**{field: value})


def test_configure_without_ray_passes_engine_kwargs_through():
    kwargs = {"dtype": "float32", "max_model_len": 256}
    assert configure_engine_kwargs(kwargs) == kwargs
    assert ADDITIONAL_CONFIG_KEY not in configure_engine_kwargs(kwargs).get("additional_config", {})


@pytest.mark.parametrize("backend", [None, "mp", "uni"])
@pytest.mark.parametrize(
    "ray_option",
    [{"placement_strategy": "SPREAD"}, {"cpus_per_rank": 2}, {"placement_group": object()}, {"cpu_binding": "0|1"}],
)
def test_configure_refuses_ray_options_without_ray_backend(backend, ray_option):
    kwargs = {"dtype": "float32", **ray_option}
    if backend is not None:
        kwargs["distributed_executor_backend"] = backend
    with pytest.raises(ValueError, match="distributed_executor_backend='ray'"):
        configure_engine_kwargs(kwargs)


def test_placement_is_frozen_and_takes_a_placement_group_object():
    placement = RankPlacement()
    with pytest.raises(ValidationError):
        placement.cpus_per_rank = 2
    group = type("PG", (), {"id": bytes.fromhex("ab" * 18)})()
    assert RankPlacement.from_options({"placement_group": group, "cpus_per_rank": 2}) == RankPlacement(
        placement_group_id="ab" * 18, cpus_per_rank=2)


def test_the_plan_is_the_only_placement_on_vllms_config():
    placement = RankPlacement(device="cpu", cpus_per_rank=2, engine_name="e", ray_address="127.0.0.1:6379")
    plan = PlacementPlan(placement=placement, world_size=3, placement_group_id="ab" * 18, owns_placement_group=True)
    assert plan.bundles == [{"CPU": 2.0}] * 3
    kwargs = engine_kwargs_with(plan, {"dtype": "float32", "additional_config": {"other": 1}})
    assert kwargs["distributed_executor_backend"].__name__ == "NNsightRayExecutor"
    assert kwargs["additional_config"]["other"] == 1
    import json

    carried = json.loads(json.dumps(kwargs["additional_config"]))  # JSON-able, as vLLM carries it
    assert PlacementPlan.from_engine_kwargs({"additional_config": carried}) == plan
    assert PlacementPlan.from_engine_kwargs({"dtype": "float32"}) is None
    with pytest.raises(ValidationError):
        plan.world_size = 4


def test_options_does_not_import_the_executor():
    import subprocess
    import sys

    code = ("import sys, nnsight_ray._internal.cluster.placement, nnsight_ray.batch.config, nnsight_ray.serve.config; "
            "sys.exit('nnsight_ray._internal.ranks.executor' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_local_ray_instance_on_a_routable_address_is_warned_about(caplog):
    from nnsight_ray._internal.cluster.placement import warn_if_reachable

    with caplog.at_level("WARNING", logger="nnsight_ray._internal.cluster.placement"):
        assert not warn_if_reachable("127.0.0.1")
        assert not warn_if_reachable("::1")
        assert not caplog.records
        assert warn_if_reachable("192.0.2.2")
    (record,) = caplog.records
    assert "192.0.2.2" in record.getMessage() and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in record.getMessage()
