"""Saved values on the wire (pure logic): the fast tensor path against nnsight's compact pickle."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest
import torch
from nnsight.modeling.vllm.collect import dumps_compact

from nnsight_ray._internal import payload

TENSORS = {
    "float32": torch.randn(3, 5),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
    "bfloat16": torch.randn(7, dtype=torch.bfloat16),
    "bool": torch.tensor([True, False, True]),
    "complex": torch.randn(2, 2, dtype=torch.complex64),
    "int64": torch.arange(6).reshape(2, 3),
    "transposed": torch.randn(4, 6).t(),
    "strided slice": torch.arange(10.0)[2:9:3],
    "expanded": torch.randn(3).expand(4, 3),
    "row of a batch": torch.randn(64, 128)[5:6],
    "needs grad": torch.randn(3, requires_grad=True),
    "parameter": torch.nn.Parameter(torch.randn(2)),
    "bfloat16 transposed": torch.randn(3, 5, dtype=torch.bfloat16).t(),
    "complex32": torch.randn(3, dtype=torch.complex64).to(torch.complex32),
    "float8": torch.randn(5).to(torch.float8_e4m3fn),
    "conjugate": torch.randn(3, dtype=torch.complex64).conj(),
    "negative bit": torch.randn(3, dtype=torch.complex64).conj().imag,
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_round_trip_keeps_type_dtype_shape_and_values(name):
    value = TENSORS[name]
    loaded = pickle.loads(payload.dumps(value))
    assert type(loaded) is type(value)
    assert loaded.dtype == value.dtype and loaded.shape == value.shape
    assert loaded.requires_grad == value.requires_grad
    assert torch.equal(loaded.detach().to(torch.complex128), value.detach().to(torch.complex128))


@pytest.mark.parametrize("name", ["float32", "row of a batch", "transposed", "needs grad", "parameter"])
def test_same_values_as_nnsight_compact(name):
    ours, theirs = pickle.loads(payload.dumps(TENSORS[name])), pickle.loads(dumps_compact(TENSORS[name]))
    assert type(ours) is type(theirs) and torch.equal(ours.detach(), theirs.detach())


def test_what_the_fast_path_cannot_write_goes_nnsights_way():
    meta = torch.empty(2, 3, device="meta")
    loaded = pickle.loads(payload.dumps(meta))
    assert loaded.device.type == "meta" and loaded.shape == (2, 3)


def test_loaded_tensors_are_writable_and_own_their_memory():
    value = pickle.loads(payload.dumps(torch.ones(4)))
    value.add_(1)  # a read-only buffer would warn or fail here
    assert torch.equal(value, torch.full((4,), 2.0))


def test_a_row_of_a_large_buffer_carries_only_itself():
    batch = torch.randn(1024, 128)
    assert len(payload.dumps(batch[3:4])) < 128 * 4 + 300


def test_one_object_saved_twice_stays_one_object():
    tensor = torch.randn(3)
    loaded = pickle.loads(payload.dumps({"a": tensor, "b": tensor}))
    assert loaded["a"] is loaded["b"]


def test_packed_unpickles_as_the_value_itself():
    value = {"saves": {"x": torch.randn(2, 3)}, "error": None}
    loaded = cloudpickle.loads(cloudpickle.dumps(payload.Packed(value)))
    assert set(loaded) == {"saves", "error"} and torch.equal(loaded["saves"]["x"], value["saves"]["x"])


def test_packed_falls_back_to_the_outer_pickler_for_what_plain_pickle_cannot_write():
    value = {"fn": lambda x: x + 1, "t": torch.ones(1)}
    loaded = cloudpickle.loads(cloudpickle.dumps(payload.Packed(value)))
    assert loaded["fn"](1) == 2 and torch.equal(loaded["t"], torch.ones(1))


def test_unserialized_returns_the_dict_and_restores_nnsight():
    from nnsight.modeling.vllm.model_runners import GPUModelRunner as runner_module

    original = runner_module.dumps_compact
    with payload.unserialized():
        assert runner_module.dumps_compact({"a": 1}) == {"a": 1}
    assert runner_module.dumps_compact is original
    with pytest.raises(RuntimeError), payload.unserialized():
        raise RuntimeError("collect failed")
    assert runner_module.dumps_compact is original


def test_to_host_batches_device_tensors_and_rebuilds_every_container(monkeypatch):
    """The grouping, chunking and splitting of ``to_host``; on this CPU-only machine CPU tensors stand in
    for device ones (``_batchable`` says which). On the GPU every save comes home this way (tests/gpu)."""
    monkeypatch.setattr(payload, "_batchable", lambda t: t.numel() < 1000)
    monkeypatch.setattr(payload, "BATCH_LIMIT", 64)  # several chunks per dtype
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts: cats.append(len(ts)) or real_cat(ts))
    shared = torch.arange(6, dtype=torch.float32).view(2, 3)
    big = torch.zeros(2000)
    entries = [
        {"saves": {"h": [torch.full((4,), float(i)) for i in range(8)], "t": (shared, shared.t()), "big": big}},
        {"saves": {"s": shared, "ids": torch.arange(3), "n": 7, "bf": torch.ones(5, dtype=torch.bfloat16)}},
        b"",
    ]
    got = payload.to_host(entries)
    assert got[2] == b"" and got[1]["saves"]["n"] == 7
    assert got[0]["saves"]["big"] is big  # too large to batch: left for the pickler
    assert [t.tolist() for t in got[0]["saves"]["h"]] == [[float(i)] * 4 for i in range(8)]
    first, transposed = got[0]["saves"]["t"]
    assert torch.equal(first, shared) and torch.equal(transposed, shared.t()) and transposed.shape == (3, 2)
    assert got[1]["saves"]["s"] is first  # one tensor saved twice stays one tensor
    assert torch.equal(got[1]["saves"]["ids"], torch.arange(3)) and got[1]["saves"]["bf"].dtype == torch.bfloat16
    assert sum(cats) == 12 and len(cats) > 3  # 12 distinct small tensors, chunks of at most 64 bytes per dtype
    assert pickle.loads(payload.dumps(got[0]))["saves"]["h"][3].tolist() == [3.0] * 4
