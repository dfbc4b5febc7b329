"""Saved values on the wire (pure logic): the fast tensor path against nnsight's compact pickle."""

from __future__ import annotations

import pickle
import pickletools
import threading

import cloudpickle
import pytest
import torch
from nnsight.modeling.vllm.collect import dumps_compact

from nnsight_ray._internal.merge import payload

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
    "contiguous negative view": torch._neg_view(torch.arange(4.0)),  # once failed alone
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


def test_every_plain_tensor_travels_in_one_buffer_per_dtype_and_loads_as_views_of_it():
    """8,192 small saves (a value at every step of 256 requests) cost one copy per dtype, not one per tensor."""
    steps = [torch.full((4,), float(i)) for i in range(64)]
    ids = torch.arange(3)
    value = {"h": steps, "pair": (steps[0], steps[0].t()), "ids": ids, "bf": torch.ones(5, dtype=torch.bfloat16),
             "n": 7, "grad": torch.ones(2, requires_grad=True)}
    data = payload.dumps(value)
    ops = [op.name for op, _, _ in pickletools.genops(data)]
    assert ops.count("BYTEARRAY8") == 3  # float32, int64, bfloat16 (the grad tensor goes nnsight's way)
    got = pickle.loads(data)
    assert [t.tolist() for t in got["h"]] == [[float(i)] * 4 for i in range(64)]
    assert got["pair"][0] is got["h"][0]  # one object saved twice stays one object
    assert torch.equal(got["ids"], ids) and got["bf"].dtype == torch.bfloat16 and got["n"] == 7
    assert got["grad"].requires_grad
    base = got["h"][0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in got["h"])  # views of one buffer
    assert len(data) < 64 * 4 * 4 + 3 * 8 + 5 * 2 + 2500


def test_loaded_views_travel_on_as_their_buffer_without_a_copy_into_a_new_one():
    """The merge actor's re-send: views of a rank's buffer go as that buffer, each an offset (no concatenation)."""
    rows = [torch.full((8,), float(i), dtype=torch.bfloat16) for i in range(32)]
    first = pickle.loads(payload.dumps({"h": rows}))
    buffers, specs = payload._pack(first["h"])
    assert len(buffers) == 1 and [s[1] for s in specs] == [8 * i for i in range(32)]
    shuffled = first["h"][::-1] + [first["h"][0][2:5]]  # any order, a view within a row, one object twice
    again = pickle.loads(payload.dumps({"h": shuffled, "same": shuffled[0]}))
    assert [t.tolist() for t in again["h"]] == [t.tolist() for t in shuffled]
    assert again["same"] is again["h"][0]
    # A view whose sign is a lazy bit (contiguous: one element) is not its storage's bytes.
    conjugate = torch.tensor([1 + 2j], dtype=torch.complex64).conj()
    assert conjugate.imag.is_neg() and conjugate.imag.is_contiguous()
    assert [t.item() for t in pickle.loads(payload.dumps([conjugate.real, conjugate.imag]))] == [1.0, -2.0]
    # A small part of a loaded buffer goes alone, not with the whole buffer.
    alone = payload.dumps(pickle.loads(payload.dumps(torch.randn(1024)))[:4])
    assert len(alone) < 4 * 4 + 300


def test_many_payloads_share_one_copy_per_dtype_and_each_loads_as_its_own_dumps(monkeypatch):
    """A batch of finished requests: one concatenation per dtype for all of them, each payload equal to
    its own ``dumps``; an unpicklable value fails only its own; chunks bound the shared copy."""
    values = [{"h": [torch.full((4,), float(i * 10 + s)) for s in range(8)], "ids": torch.arange(i + 1),
               "bf": torch.ones(3, dtype=torch.bfloat16) * i} for i in range(20)]
    values.insert(7, {"lock": threading.Lock()})
    values.insert(3, {"n": 3})  # no tensor at all
    cats = []
    real_cat = payload._flatten_dense_tensors  # the concatenation (PyTorch's flatten-and-cat)
    monkeypatch.setattr(payload, "_flatten_dense_tensors", lambda parts: cats.append(len(parts)) or real_cat(parts))
    results = payload.dumps_each(values)
    assert len(cats) == 3  # float32, int64, bfloat16: once each for the 20 payloads that carry tensors
    assert isinstance(results[8], TypeError) and pickle.loads(results[3]) == {"n": 3}
    for value, result in zip(values, results):
        if isinstance(result, bytes) and "h" in value:
            got = pickle.loads(result)
            assert [t.tolist() for t in got["h"]] == [t.tolist() for t in value["h"]]
            assert torch.equal(got["ids"], value["ids"]) and torch.equal(got["bf"], value["bf"])
            assert len(result) < len(payload.dumps(value)) + 64  # carries only its own tensors
    monkeypatch.setattr(payload, "PACK_CHUNK_BYTES", 64)  # every few tensors a chunk: same values
    chunked = payload.dumps_each(values)
    assert [pickle.loads(r)["h"][5].tolist() for r in chunked if isinstance(r, bytes) and b"h" in r][:3] == \
        [[5.0] * 4, [15.0] * 4, [25.0] * 4]


def test_packed_buffers_go_out_of_band_and_load_writable_from_read_only_memory():
    """Ray pickles with protocol 5 and a buffer callback: the tensors' bytes bypass the pickle stream."""
    value = {"h": [torch.randn(256) for _ in range(16)], "ids": torch.arange(4)}
    out_of_band: list = []
    data = pickle.dumps(payload.Packed(value), protocol=5, buffer_callback=out_of_band.append)
    assert len(out_of_band) == 2 and len(data) < 2000  # float32 and int64 buffers, outside the stream
    loaded = pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in out_of_band])
    assert all(torch.equal(a, b) for a, b in zip(loaded["h"], value["h"])) and torch.equal(loaded["ids"], value["ids"])
    loaded["h"][0].add_(1)  # writable: copied out of the read-only buffer once
    assert torch.equal(loaded["h"][0], value["h"][0] + 1)
    old = pickle.loads(pickle.dumps(payload.Packed(value), protocol=4))  # no PickleBuffer before protocol 5
    assert torch.equal(old["ids"], value["ids"]) and torch.equal(old["h"][3], value["h"][3])


def test_packed_collect_serializes_with_dumps_and_an_outer_choice_wins():
    """LocalVLLM's workers pack what nnsight collects; a rank's stash (unserialized, outer) keeps the dict."""
    from nnsight.modeling.vllm.model_runners import GPUModelRunner as runner_module

    original = runner_module.dumps_compact
    value = {"r": {"saves": {"h": [torch.ones(3), torch.zeros(2)]}}}
    with payload.packed():
        assert runner_module.dumps_compact is payload.dumps
        data = runner_module.dumps_compact(value)
        with payload.unserialized():  # inner: the outer choice stands
            assert runner_module.dumps_compact is payload.dumps
    assert runner_module.dumps_compact is original
    assert torch.equal(pickle.loads(data)["r"]["saves"]["h"][0], torch.ones(3))
    with payload.unserialized():
        with payload.packed():
            assert runner_module.dumps_compact(value) is value
    assert runner_module.dumps_compact is original and payload.collect_serializer() is original


def test_only_objects_pickle_cannot_write_natively_reach_python(monkeypatch):
    """A prefill output is mostly token ids: pickle writes ints, lists and strings itself; only the
    other objects (here the tensor, and the function it reduces to, once) reach the pickler's Python hook."""
    seen = []
    monkeypatch.setattr(payload, "_packable", lambda obj: seen.append(type(obj)) or type(obj) is torch.Tensor)
    value = {"ids": list(range(10_000)), "text": "x" * 100, "h": torch.ones(3), "pair": (1.5, None)}
    loaded = pickle.loads(payload.dumps(value))
    assert sorted(t.__name__ for t in seen) == ["Tensor", "function"]
    assert loaded["ids"] == value["ids"] and torch.equal(loaded["h"], value["h"])


def test_a_payload_inside_a_payload_loads_its_own_tensors():
    inner = payload.Packed({"b": torch.full((2,), 7.0)})
    value = [torch.zeros(3), inner, torch.ones(4)]
    loaded = pickle.loads(payload.dumps(value))
    assert torch.equal(loaded[0], torch.zeros(3)) and torch.equal(loaded[2], torch.ones(4))
    assert torch.equal(loaded[1]["b"], torch.full((2,), 7.0))


def _through_ray(value):
    """What Ray does with a call's result: protocol 5, buffers out of band, read-only where they land."""
    buffers: list = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in buffers]), data, buffers


def test_a_shipped_payload_carries_its_tensors_out_of_band_and_loads_writable():
    """rank -> merge actor (``ship_each``): the tensors' bytes never enter the pickle stream; what arrives
    is bytes nnsight's ``merge_collected`` can load (inside ``arrived``), its tensors writable copies."""
    values = [{f"r{i}": {"saves": {"h": [torch.full((64,), float(i * 100 + s)) for s in range(32)],
                                   "ids": torch.arange(3)}, "error": None, "registered": {}, "sequences": {}}}
              for i in range(8)]
    shipped = payload.ship_each(values)
    assert all(isinstance(s, payload.Shipped) for s in shipped)
    for value, one in zip(values, shipped):
        got, data, buffers = _through_ray(one)
        assert isinstance(got, payload.Arrived) and len(buffers) == 2  # float32 and int64, out of band
        assert len(data) < 4000 and got.nbytes == len(got) + 32 * 64 * 4 + 3 * 8
        (rid, entry), = payload.loads(got).items()
        assert [t.tolist() for t in entry["saves"]["h"]] == [t.tolist() for t in value[rid]["saves"]["h"]]
        entry["saves"]["h"][0].add_(1)  # writable: copied out of the read-only buffer once
        with pytest.raises(pickle.UnpicklingError, match="payload.loads"):
            pickle.loads(got)  # its tensors live beside it, not in its bytes
    old = pickle.loads(pickle.dumps(shipped[2], protocol=4))  # no PickleBuffer before protocol 5
    assert payload.loads(old)["r2"]["saves"]["h"][5].tolist() == [205.0] * 64


def test_nnsights_merge_reads_several_ranks_shipped_payloads_of_one_request():
    """Tensor/pipeline-parallel ranks each ship their part of a request; nnsight's ``merge_collected``
    (inside ``arrived``) unions them, each rank's tensors found by its own payload's token."""
    from nnsight.modeling.vllm.engines.engine import merge_collected

    def entry(saves):
        return {"rq": {"saves": saves, "error": None, "registered": {}, "sequences": {}}}

    stage0 = payload.ship_each([entry({"a": torch.ones(4)})])[0]
    stage1 = payload.ship_each([entry({"b": torch.zeros(2), "n": 7})])[0]
    plain = payload.dumps(entry({"c": torch.full((3,), 2.0)}))  # an older rank's bytes
    present = [_through_ray(stage0)[0], _through_ray(stage1)[0], plain]
    with payload.arrived(present):
        merged = merge_collected(present)["rq"]["saves"]
    assert sorted(merged) == ["a", "b", "c", "n"]
    assert torch.equal(merged["a"], torch.ones(4)) and torch.equal(merged["b"], torch.zeros(2))
    assert torch.equal(merged["c"], torch.full((3,), 2.0)) and merged["n"] == 7


def test_tensors_of_one_shape_back_to_back_load_as_separate_views_of_one_buffer():
    """A value saved at every step (rows of one shape, packed in order) loads with one view per run of shapes."""
    steps = [torch.randn(1, 8) for _ in range(5)] + [torch.randn(3, 8)] + [torch.randn(1, 8) for _ in range(2)]
    value = {"steps": steps + [torch.randn(8), torch.tensor(1.5)], "pair": (steps[0], steps[0])}
    loaded = pickle.loads(payload.dumps(value))
    for got, want in zip(loaded["steps"], value["steps"]):
        assert got.shape == want.shape and got.is_contiguous() and torch.equal(got, want)
    assert loaded["pair"][0] is loaded["pair"][1]  # one object saved twice is one tensor
    loaded["steps"][1].fill_(0)  # each is its own rows of the buffer
    assert torch.equal(loaded["steps"][0], steps[0]) and torch.equal(loaded["steps"][2], steps[2])
    assert payload._views([(bytearray(4 * 6), torch.float32)], [(0, 0, 2, (2,)), (0, 2, 2, (2,)), (0, 4, 2, (1, 2))]) \
        and [list(r) for r in payload._runs([0, 1, 2], [(0, 0, 2, (2,)), (0, 2, 2, (2,)), (0, 4, 2, (1, 2))])] == [[0, 1], [2]]


def test_tensors_are_packed_in_the_payload_order_views_of_other_buffers_or_not():
    """A cache's (hidden, residual) per step on a CPU rank: a view of the step's batch, then a tensor of its own.
    Packed in the payload's order they lie back to back, and arrive as one view per run of one shape."""
    steps = [torch.randn(4, 8) for _ in range(3)]
    tensors = [t for step in steps for t in (step[1:2], step[2:3].clone())]
    _, specs = payload._pack(tensors)
    assert [spec[1] for spec in specs] == [8 * i for i in range(6)]
    assert [len(run) for run in payload._runs(list(range(6)), specs)] == [6]
    loaded = pickle.loads(payload.dumps(tensors))
    assert all(torch.equal(a, b) for a, b in zip(loaded, tensors))
