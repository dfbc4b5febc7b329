"""Engine parity's pure logic (issue 22.2): entry-point defaults, nnsight's settings, the ranks' tables."""

from __future__ import annotations

import pytest

from nnsight_ray._internal.engine import parity


def test_offline_engines_take_llms_defaults_and_nnsights_settings_never_over_the_users():
    kwargs, changed = parity.entrypoint_kwargs({"enable_prefix_caching": True, "max_model_len": 64}, parity.OFFLINE)
    assert kwargs["disable_log_stats"] is True  # vllm.LLM.__init__'s default
    assert kwargs["enable_prefix_caching"] is True and kwargs["enable_chunked_prefill"] is False
    assert kwargs["enforce_eager"] is True and kwargs["max_model_len"] == 64
    assert [c.split("=")[0] for c in changed] == ["enable_chunked_prefill", "enforce_eager"]
    assert all("(" in c for c in changed)  # each with its reason


def test_server_engines_keep_stats_logging_as_vllms_openai_server_does():
    kwargs, _ = parity.entrypoint_kwargs({}, parity.SERVER)
    assert "disable_log_stats" not in kwargs
    assert parity.entrypoint_kwargs({"disable_log_stats": False}, parity.OFFLINE)[0]["disable_log_stats"] is False


def test_usage_context_is_validated():
    assert parity.usage_context(None) == parity.OFFLINE
    with pytest.raises(ValueError, match="LLM_CLASS"):
        parity.usage_context("ENGINE_CONTEXT")


def test_the_ranks_tables_reach_vllm_through_get_batch_defaults():
    from vllm.usage.usage_lib import UsageContext

    h200 = ({"LLM_CLASS": 16384, "OPENAI_API_SERVER": 8192}, {"LLM_CLASS": 1024, "OPENAI_API_SERVER": 1024}, "H200")
    args = parity.build_engine_args({"model": "/models/none"}, h200)
    tokens, seqs = args.get_batch_defaults(1)
    assert tokens[UsageContext.LLM_CLASS] == 16384 and seqs[UsageContext.OPENAI_API_SERVER] == 1024
    # without a probe, vLLM's own tables for this process's platform
    own = parity.build_engine_args({"model": "/models/none"}, None).get_batch_defaults(2)
    assert own == type(args).__mro__[1].get_batch_defaults(2)


def test_probe_names_its_tables_by_context_and_device():
    tokens, seqs, device = parity.probe_batch_defaults(1)
    assert set(tokens) >= {"LLM_CLASS", "OPENAI_API_SERVER"} and set(seqs) >= {"LLM_CLASS"}
    assert isinstance(device, str)


def test_config_differences_are_field_by_field():
    assert parity.differences({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == {"b": ("2", "3"),
                                                                                         "c": (None, "4")}
