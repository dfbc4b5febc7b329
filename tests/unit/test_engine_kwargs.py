"""Engine keywords every entry point passes through ``deploy.launch`` (RayVLLM, Serve, batch)."""

from __future__ import annotations

import pytest

from nnsight_ray._internal.deploy import eager_engine_kwargs
from nnsight_ray.errors import RequestError


def test_enforce_eager_true_is_accepted_as_what_happens_anyway():
    assert eager_engine_kwargs({"enforce_eager": True, "max_model_len": 64}) == {"max_model_len": 64}
    assert eager_engine_kwargs({"max_model_len": 64}) == {"max_model_len": 64}


def test_enforce_eager_false_is_refused_with_the_reason():
    with pytest.raises(RequestError, match="enforce_eager=False: nnsight_ray engines run eagerly.*Drop enforce_eager"):
        eager_engine_kwargs({"enforce_eager": False})
