"""vLLM's GPU defaults the project overrides, and says so (docs/gpu.md): the V1 model runner."""

from __future__ import annotations

import pytest

KEY = "VLLM_USE_V2_MODEL_RUNNER"


def test_v1_runner_is_chosen_explicitly_and_reaches_every_rank(monkeypatch):
    from nnsight_ray import LocalVLLM
    from nnsight_ray._internal.deploy import forwarded_env

    monkeypatch.delenv(KEY, raising=False)
    LocalVLLM._require_v1_model_runner()  # what every engine start runs (LocalVLLM, the engine actor)
    import os

    assert os.environ[KEY] == "0"
    assert forwarded_env()[KEY] == "0"  # the engine actor, its engine core and its ranks inherit it


def test_forcing_the_v2_runner_is_refused_with_what_to_do(monkeypatch):
    from nnsight_ray import LocalVLLM

    monkeypatch.setenv(KEY, "1")
    with pytest.raises(NotImplementedError, match=f"{KEY}='1' selects vLLM's V2 GPU model runner.*Unset it"):
        LocalVLLM._require_v1_model_runner()
