"""Engine keywords every entry point passes through ``deploy.launch`` (RayVLLM, Serve, batch): eager, graphs, taps."""

from __future__ import annotations

import pytest

from nnsight_ray._internal.blocks.graphs import TAPS_KEY, engine_env, engine_mode
from nnsight_ray.errors import RequestError


def test_nothing_asked_leaves_nnsights_eager_default_to_parity():
    assert engine_mode({"max_model_len": 64}) == ({"max_model_len": 64}, [])
    assert engine_env({"max_model_len": 64}) == {}


def test_enforce_eager_true_is_an_eager_engine():
    kwargs, changed = engine_mode({"enforce_eager": True, "max_model_len": 64})
    assert kwargs == {"enforce_eager": True, "max_model_len": 64} and changed == []
    assert engine_env(kwargs) == {}


def test_enforce_eager_false_is_a_graph_engine_without_torch_compile():
    kwargs, changed = engine_mode({"enforce_eager": False})
    assert kwargs["enforce_eager"] is False and kwargs["additional_config"] == {TAPS_KEY: []}
    assert engine_env(kwargs) == {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH=1" in changed[0]


def test_taps_ride_additional_config_beside_the_users_own():
    kwargs, _ = engine_mode({"taps": ["model.layers.*.output"], "additional_config": {"mine": 1}})
    assert kwargs["enforce_eager"] is False and "taps" not in kwargs
    assert kwargs["additional_config"] == {"mine": 1, TAPS_KEY: ["model.layers.*.output"]}


def test_taps_are_accepted_at_any_pipeline_size():
    # At PP > 1 a block's step runs eagerly (graphs.served_taps); the taps still ride to the ranks.
    kwargs, _ = engine_mode({"taps": ["model.layers.*.output"], "pipeline_parallel_size": 2,
                             "tensor_parallel_size": 2})
    assert kwargs["enforce_eager"] is False and kwargs["pipeline_parallel_size"] == 2
    assert kwargs["additional_config"][TAPS_KEY] == ["model.layers.*.output"]


@pytest.mark.parametrize("kwargs, words", [
    ({"taps": ["model.layers.*.output"], "enforce_eager": True}, "contradicts taps"),
    ({"taps": [3]}, "taps must be strings"),
])
def test_contradictions_are_refused_in_words(kwargs, words):
    with pytest.raises(RequestError, match=words):
        engine_mode(kwargs)
