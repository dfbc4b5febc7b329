"""``tracer.cache()`` across ranks: each rank's ``Cache`` holds the modules that ran there; the merge unions them."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import torch
from nnsight.intervention.cache import Cache, CacheView, Entry

from nnsight_ray._internal.merge.book import merge_request


def _payload(request_id: str, entries: dict, other: dict | None = None) -> bytes:
    cache = Cache(None, modules=list(entries))
    cache.entries = {path: [Entry(output=value)] for path, value in entries.items()}
    saves = {"cache": CacheView(cache, None), **(other or {})}
    return pickle.dumps({request_id: {"saves": saves, "error": None, "registered": {}, "sequences": {}}})


def test_pipeline_stages_caches_are_unioned_in_rank_order():
    stage0 = _payload("r", {"model.h.0": torch.ones(2), "model.t": "intermediate"})
    stage1 = _payload("r", {"model.h.1": torch.full((2,), 2.0), "model.t": "final"}, {"x": 3})
    output = merge_request(SimpleNamespace(outputs=[]), "r", [stage0, None, stage1])
    cache = output.nnsight_saves["cache"]
    assert set(cache.keys()) == {"model.h.0", "model.h.1", "model.t"}
    assert torch.equal(cache["model.h.0"].output, torch.ones(2))
    assert torch.equal(cache["model.h.1"].output, torch.full((2,), 2.0))
    assert cache["model.t"].output == "final"  # called on both stages: the last stage's is the model's output
    assert "model.h.0" in cache and "model.h.1" in cache
    assert output.saves["cache"].keys() == cache.keys() and output.nnsight_saves["x"] == 3


def test_one_rank_and_no_cache_are_untouched():
    only = _payload("r", {"model.h.0": torch.ones(1)})
    output = merge_request(SimpleNamespace(outputs=[]), "r", [only])
    assert list(output.nnsight_saves["cache"].keys()) == ["model.h.0"]
    plain = pickle.dumps({"r": {"saves": {"y": 1}, "error": None, "registered": {}, "sequences": {}}})
    output = merge_request(SimpleNamespace(outputs=[]), "r", [plain, plain])
    assert output.nnsight_saves == {"y": 1}


def test_a_request_summary_is_its_prompt_ids_and_first_completion():
    """What trace(outputs=True) hands the caller per invoke; a request without output (failed) is empty."""
    from nnsight_ray._internal.merge.book import request_summary

    completion = SimpleNamespace(token_ids=(7, 8), text="ab")
    output = SimpleNamespace(prompt_token_ids=(1, 2, 3), outputs=[completion, SimpleNamespace(token_ids=(9,), text="c")])
    assert request_summary(output) == {"prompt_token_ids": [1, 2, 3], "token_ids": [7, 8], "text": "ab"}
    assert request_summary(None) == {"prompt_token_ids": [], "token_ids": [], "text": ""}
    assert request_summary(SimpleNamespace(prompt_token_ids=None, outputs=[])) == {
        "prompt_token_ids": [], "token_ids": [], "text": ""}
