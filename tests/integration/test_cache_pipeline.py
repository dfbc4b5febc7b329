"""``tracer.cache()`` at PP=2 gives what one device gives: every stage's modules, the same values.

Each pipeline stage's ``Cache`` records the modules that ran there; the merge
actor unions them (``merge.merge_caches``). Compared against ``local_llama``
(nnsight's in-process engine on the same checkpoint).
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, ray_engine

pytestmark = pytest.mark.integration

PROMPT = "Hello world"


@pytest.fixture(scope="module")
def pp2(request, model_dir):
    model = ray_engine(request, model_dir, "cachepp2", pipeline_parallel_size=2, placement_strategy="STRICT_SPREAD")
    yield model
    model.shutdown()


def _cache(model, **kwargs):
    with model.trace(PROMPT, temperature=0.0, top_p=1, max_tokens=1) as tracer:
        cache = tracer.cache(**kwargs)
    return cache


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _differences(got, ref) -> list[str]:
    wrong = []
    # A path of one component (the root, "model") cannot be looked up in a cache that crossed a process
    # boundary (nnsight resolves it through the dropped envoy), on LocalVLLM as here.
    for path in (p for p in ref.keys() if "." in p):
        expected, actual = _tensors(ref[path].output), _tensors(got[path].output)
        if len(actual) != len(expected):
            wrong.append(f"{path}: {len(actual)} tensors, one device {len(expected)}")
            continue
        for a, e in zip(actual, expected):
            err = ((a.float() - e.float()).norm() / e.float().norm().clamp_min(1e-12)).item() if a.shape == e.shape else None
            if err is None or err >= 1e-3:
                wrong.append(f"{path}: {tuple(a.shape)} vs {tuple(e.shape)}, relative error {err}")
                break
    return wrong


def test_full_cache_matches_single_device(pp2, local_llama):
    ref, got = _cache(local_llama), _cache(pp2)
    layers = [f"model.model.layers.{i}" for i in range(4)]
    assert all(path in got for path in layers), got
    assert set(got.keys()) == set(ref.keys())
    wrong = _differences(got, ref)
    # vLLM builds one rotary embedding (``get_rope`` caches it) and every layer's attention holds it: on one
    # device each layer's ``rotary_emb`` path records all four layers' calls, on a stage only its own layers'.
    shared = [w for w in wrong if ".rotary_emb:" in w]
    assert [w for w in wrong if w not in shared] == []
    assert all("2 tensors" in w or "4 tensors" in w for w in shared), shared


def test_selected_modules_from_both_stages(pp2, local_llama):
    modules = lambda m: [m.model.layers[0], m.model.layers[-1]]  # noqa: E731
    ref, got = _cache(local_llama, modules=modules(local_llama)), _cache(pp2, modules=modules(pp2))
    assert sorted(got.keys()) == sorted(ref.keys()) == ["model.model.layers.0", "model.model.layers.3"]
    assert "model.model.layers.1" not in got
    for path in ref.keys():
        for a, e in zip(_tensors(got[path].output), _tensors(ref[path].output)):
            assert_close(a, e)
