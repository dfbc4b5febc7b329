"""The extraction writer's memory hand-back (``_internal/extract.Writer``), on CPU tensors (no engine)."""

from __future__ import annotations

import gc
import re
import threading
import time
import weakref

import torch

from nnsight_ray._internal.extract import capture as extract, rows as extract_rows, host_memory


def test_an_idle_writer_returns_pinned_memory_after_the_rows_are_freed(tmp_path, monkeypatch):
    """Pinned blocks go back only once nothing holds them: the part's rows are freed before the release."""
    releases = []
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    alive = weakref.ref(rows)
    monkeypatch.setattr(extract, "release_pinned_cache", lambda: releases.append(alive() is None))
    writer = extract.Writer(0, 1, True)
    writer.idle_after_s = 0  # at once
    spec = {"part": "p0", "index": 0, "dir": str(tmp_path), "locations": ["model.layers.0.output"]}
    step = extract.StepCapture(torch.arange(6), [("r0", 0, 6, list(range(6)), spec, 0)], None,
                               values={"model.layers.0.output": rows})
    del rows
    writer.submit("capture", step)
    del step
    written = writer.submit("commit", ("p0", False))
    assert written["rows"] == 6 and (tmp_path / "p0.safetensors").exists()
    assert releases == [True]  # once, idle, with the rows already gone
    assert writer.writing == 0 and not writer.parts


def test_a_writer_still_holding_parts_keeps_its_pinned_cache(tmp_path, monkeypatch):
    releases = []
    monkeypatch.setattr(extract, "release_pinned_cache", lambda: releases.append(1))
    writer = extract.Writer(0, 1, True)
    writer.idle_after_s = 0
    for part in ("a", "b"):
        spec = {"part": part, "index": 0, "dir": str(tmp_path), "locations": ["x.output"]}
        writer.submit("capture", extract.StepCapture(torch.arange(2), [("r", 0, 2, [1, 2], spec, 0)], None,
                                                     values={"x.output": torch.ones(2, 3)}))
    writer.submit("commit", ("a", False))
    assert releases == []  # part b is still held
    writer.submit("commit", ("b", False))
    assert releases == [1]


def _capture(writer, part, tmp_path):
    spec = {"part": part, "index": 0, "dir": str(tmp_path), "locations": ["x.output"]}
    writer.submit("capture", extract.StepCapture(torch.arange(2), [("r", 0, 2, [1, 2], spec, 0)], None,
                                                 values={"x.output": torch.ones(2, 3)}))


def test_the_pinned_cache_goes_back_only_after_the_writer_stays_idle(tmp_path, monkeypatch):
    """Work that goes on (the next run's captures) keeps its pinned blocks; a writer left idle returns them."""
    releases = []
    monkeypatch.setattr(extract, "release_pinned_cache", lambda: releases.append(time.monotonic()))
    writer = extract.Writer(0, 1, True)
    writer.idle_after_s = 0.3
    _capture(writer, "a", tmp_path)
    writer.submit("commit", ("a", False))
    _capture(writer, "b", tmp_path)  # the next part arrives within the idle time: no release for "a"
    time.sleep(0.5)
    assert releases == []
    done = time.monotonic()
    writer.submit("commit", ("b", False))
    time.sleep(0.6)
    assert len(releases) == 1 and releases[0] - done >= 0.25


def test_row_index_is_a_span_when_the_rows_are_contiguous_and_an_index_otherwise():
    """A step whose captured rows are one span (every request asking, as in a dataset run) needs no
    index tensor: ``capture`` copies the span's view. Both forms take the same rows."""
    assert extract_rows.row_index([(0, 3), (3, 4), (7, 2)], "cpu") == range(0, 9)
    assert extract_rows.row_index([(5, 2)], "cpu") == range(5, 7)
    gapped = extract_rows.row_index([(0, 2), (5, 3)], "cpu")
    assert isinstance(gapped, torch.Tensor) and gapped.tolist() == [0, 1, 5, 6, 7]
    hidden, residual = torch.randn(12, 4), torch.randn(12, 4)
    for spans in ([(2, 3), (5, 4)], [(0, 2), (5, 3)]):
        rows = [r for a, n in spans for r in range(a, a + n)]
        want = hidden[rows] + residual[rows]
        got = extract_rows.capture((hidden, residual), extract_rows.row_index(spans, "cpu"))
        assert torch.equal(got, want)
        alone = extract_rows.capture(hidden, extract_rows.row_index(spans, "cpu"))
        assert torch.equal(alone, hidden[rows])
        alone.add_(1)  # a copy: the model's tensor is untouched
        assert torch.equal(hidden[rows] + 1, alone)


def test_the_memory_gauge_counts_held_parts_until_they_are_committed(tmp_path, monkeypatch):
    """``extract.memory`` (a rank's ``nnsight_ray_extract_memory``) reports this process's writer."""
    writer = extract.Writer(0, 1, True)
    monkeypatch.setattr(extract, "_writer", writer)
    _capture(writer, "a", tmp_path)
    _capture(writer, "b", tmp_path)
    assert extract.memory()["parts"] == 2
    writer.submit("commit", ("a", False))
    writer.submit("commit", ("b", False))
    assert extract.memory() == {"parts": 0, "writing": 0, "host_mb": 0.0}  # no CUDA here: no pinned figures


# -- the staging ring and the host buffers (the GPU path's memory, on CPU tensors) -----------------


def test_the_ring_hands_out_spans_first_in_first_out_and_wraps():
    ring = host_memory.PinnedRing(4 * 4096, pin=False)
    a = ring.take(torch.Size([1024]), torch.float32, step=1)  # one page each
    b = ring.take(torch.Size([2, 512]), torch.float32, step=1)
    c = ring.take(torch.Size([1024]), torch.float32, step=2)
    assert [s[:2] for s in ring.spans] == [(0, 4096), (4096, 8192), (8192, 12288)]
    a.fill_(1), b.fill_(2), c.fill_(3)
    ring.give(1)
    d = ring.take(torch.Size([2048]), torch.float32, step=3)  # 2 pages: not after c (1 left), so at the start
    assert [s[:2] for s in ring.spans] == [(8192, 12288), (0, 8192)]
    assert torch.equal(c, torch.full((1024,), 3.0))  # d did not overwrite c
    d.fill_(4)
    assert ring.take(torch.Size([1024]), torch.float32, step=3, timeout=0.1) is None  # full of its own step
    assert ring.used() == 3 * 4096
    ring.give(3)
    assert ring.used() == 0 and not ring.spans


def test_a_full_ring_makes_the_next_step_wait_for_the_writer():
    """Back-pressure: a hook waits while earlier steps fill the ring, and goes on once they are copied out."""
    ring = host_memory.PinnedRing(2 * 4096, pin=False)
    ring.take(torch.Size([2048]), torch.float32, step=1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.take(torch.Size([1024]), torch.float32, step=2)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # still waiting for step 1's span
    ring.give(1)
    waiter.join(5)
    assert got and got[0] is not None and ring.waited_s >= 0.15
    assert ring.take(torch.Size([10 * 1024]), torch.float32, step=3) is None  # larger than the ring: never fits


def test_host_buffers_go_back_to_the_system_when_their_last_view_dies():
    before = extract._mapped[0]
    rows = extract.host_buffer((256, 1024), torch.bfloat16)  # 512 KiB
    assert extract._mapped[0] - before == 256 * 1024 * 2
    view = rows.narrow(0, 10, 5)
    rows.fill_(1.5)
    del rows
    gc.collect()
    assert extract._mapped[0] - before == 256 * 1024 * 2  # a view keeps it
    assert torch.equal(view, torch.full((5, 1024), 1.5, dtype=torch.bfloat16))
    del view
    assert extract._mapped[0] == before
    assert extract.host_buffer((0, 8), torch.float32).shape == (0, 8)


def test_capture_computes_straight_into_a_host_buffer_in_the_asked_dtype():
    hidden, residual = torch.randn(12, 4), torch.randn(12, 4)
    for rows in (range(2, 9), torch.tensor([0, 3, 5])):
        want = hidden[torch.as_tensor(list(rows))] + residual[torch.as_tensor(list(rows))]
        got = extract_rows.capture((hidden, residual), rows, torch.bfloat16, extract.host_buffer)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
        alone = extract_rows.capture(hidden, rows, None, extract.host_buffer)
        assert torch.equal(alone, hidden[torch.as_tensor(list(rows))])


def test_the_writer_copies_a_step_out_of_the_ring_frees_it_and_writes_the_rows(tmp_path, monkeypatch):
    """The GPU path's filing on CPU tensors: ring views -> host buffers, the ring freed at once, the rows
    written exactly, and nothing held once the part is committed."""
    from safetensors.torch import load_file

    monkeypatch.setattr(host_memory, "COPY_CHUNK_BYTES", 4096 * 3)  # 14 pieces, copied by the pool
    writer = extract.Writer(0, 1, True)
    writer.host.mode = "ring"
    writer.host.ring = host_memory.PinnedRing(1 << 20, pin=False)
    monkeypatch.setattr(extract, "_writer", writer)
    want = torch.randn(40, 1024, dtype=torch.float32) * 100
    staged = writer.host.ring.take(want.shape, want.dtype, step=7)
    staged.copy_(want)
    spec = {"part": "p", "index": 0, "dir": str(tmp_path), "locations": ["m.output"]}
    spec2 = dict(spec, index=1)
    step = extract.StepCapture(range(0, 40), [("a", 0, 25, list(range(25)), spec, 0), ("b", 25, 15, list(range(15)), spec2, 0)],
                               None, values={"m.output": staged}, step=7)
    del staged
    writer.submit("capture", step)
    assert writer.host.ring.used() == 0  # copied out and freed when filed
    assert not (step.values["m.output"].data_ptr() == writer.host.ring.buffer.data_ptr())
    del step
    assert extract.memory()["host_mb"] > 0
    written = writer.submit("commit", ("p", False))
    assert written["rows"] == 40
    data = load_file(str(tmp_path / "p.safetensors"))
    assert torch.equal(data["m.output"], want) and data["prompt_index"].tolist() == [0] * 25 + [1] * 15
    gc.collect()
    held = extract.memory()
    assert held["host_mb"] == 0 and held["parts"] == 0 and held["ring_used_mb"] == 0


def _pool_writer(monkeypatch, slabs: int, slab_bytes: int = 64 * 1024) -> "extract.Writer":
    writer = extract.Writer(0, 1, True)
    writer.host.mode = "pool"
    writer.host.slabs = host_memory.SlabPool(slab_bytes, slabs, pin=False)
    monkeypatch.setattr(extract, "_writer", writer)
    return writer


def test_the_pool_lends_a_slab_per_location_and_takes_it_back_when_every_part_holding_it_is_written(tmp_path,
                                                                                                   monkeypatch):
    """``STAGING=pool``: a step's rows at each location go into one slab (no copy more); a step whose
    rows belong to two parts keeps its slab until both are written (or dropped); the files are exact."""
    from safetensors.torch import load_file

    writer = _pool_writer(monkeypatch, slabs=4)
    specs = [{"part": part, "index": i, "dir": str(tmp_path), "locations": ["m.output", "n.output"]}
             for i, part in enumerate(["a", "b", "c"])]
    want = {loc: torch.randn(30, 16) for loc in ("m.output", "n.output")}
    step = extract.StepCapture(range(0, 30), [("r0", 0, 10, list(range(10)), specs[0], 0),
                                              ("r1", 10, 20, list(range(20)), specs[1], 0)], None, step=1)
    for loc, rows in want.items():
        step.values[loc] = writer.to_host(rows, step)
    assert len(step.slabs) == 2 and writer.host.slabs.lent() == 2
    writer.submit("capture", step)
    del step
    assert writer.host.slabs.lent() == 2  # held by parts a and b
    assert writer.submit("commit", ("a", False))["rows"] == 10
    assert writer.host.slabs.lent() == 2  # b still holds them
    assert writer.submit("commit", ("b", False))["rows"] == 20
    assert writer.host.slabs.lent() == 0 and extract.memory()["pool_lent"] == 0
    for part, first, count in (("a", 0, 10), ("b", 10, 20)):
        data = load_file(str(tmp_path / f"{part}.safetensors"))
        for loc, rows in want.items():
            assert torch.equal(data[loc], rows[first:first + count])
    other = extract.StepCapture(range(0, 5), [("r2", 0, 5, list(range(5)), specs[2], 0)], None, step=2)
    other.values["m.output"] = writer.to_host(torch.randn(5, 16), other)
    writer.submit("capture", other)
    del other
    assert writer.host.slabs.lent() == 1
    writer.submit("discard", "c")  # a dropped part gives its slabs back too
    assert writer.host.slabs.lent() == 0 and not writer.parts and writer.host.overflows == 0


def test_a_full_pool_waits_while_files_are_written_and_else_stages_in_a_host_buffer(tmp_path, monkeypatch):
    """No free slab: ``take`` waits while ``busy()`` (the writer has files to write) and lends the slab
    given back; with nothing being written (every slab holds rows of incomplete parts) the rows go to a
    pageable host buffer at once, counted as an overflow, and still reach their file."""
    from safetensors.torch import load_file

    pool = host_memory.SlabPool(4096, 1, pin=False)
    held = pool.take(100)
    assert held is not None and pool.take(100) is None  # none free, nothing written: no wait
    assert pool.take(8192) is None  # larger than a slab
    threading.Timer(0.2, held.release).start()
    started = time.monotonic()
    again = pool.take(100, busy=lambda: True)
    assert again is held and time.monotonic() - started >= 0.15 and pool.waited_s >= 0.15

    writer = _pool_writer(monkeypatch, slabs=1)
    spec = {"part": "p", "index": 0, "dir": str(tmp_path), "locations": ["m.output"]}
    first = extract.StepCapture(range(0, 4), [("r0", 0, 4, list(range(4)), spec, 0)], None, step=1)
    first.values["m.output"] = writer.to_host(torch.ones(4, 16), first)
    writer.submit("capture", first)
    rows = torch.randn(6, 16)
    second = extract.StepCapture(range(0, 6), [("r1", 0, 6, list(range(6)), dict(spec, index=1), 0)], None, step=2)
    second.values["m.output"] = writer.to_host(rows, second)
    assert not second.slabs and writer.host.overflows == 1 and extract.memory()["host_mb"] > 0
    writer.submit("capture", second)
    del first, second
    assert writer.submit("commit", ("p", False))["rows"] == 10
    data = load_file(str(tmp_path / "p.safetensors"))
    assert torch.equal(data["m.output"][4:], rows) and torch.equal(data["m.output"][:4], torch.ones(4, 16))
    gc.collect()
    held = extract.memory()
    assert held["host_mb"] == 0 and held["pool_lent"] == 0 and held["pool_overflows"] == 1


def test_the_pool_is_made_once_for_the_largest_step_and_two_steps_at_least(monkeypatch):
    monkeypatch.setattr(host_memory, "PINNED_MB", 1)  # 1 MiB: 16 slabs of 64 KiB
    writer = extract.Writer(0, 1, True)
    pool = writer.host.ensure_slabs(64 * 1024, 4)
    assert (pool.count, pool.slab_bytes) == (16, 64 * 1024) and writer.host.ensure_slabs(64 * 1024, 4) is pool
    assert writer.host.ensure_slabs(512 * 1024, 4).count == 8  # larger slabs (none lent): remade, two steps of 4
    assert writer.host.drop() and writer.host.slabs is None


def test_the_staging_changes_only_while_the_writer_holds_nothing(tmp_path, monkeypatch):
    """``nnsight_ray_extract_staging``: a bad mode says which ones exist; a writer holding a part keeps its
    staging until the part is committed; switching away from the ring drops it (an idle one)."""
    import pytest

    writer = extract.Writer(0, 1, True)
    monkeypatch.setattr(extract, "_writer", writer)
    assert writer.host.mode == "pool"  # the default
    with pytest.raises(ValueError, match="expected one of pool, cache, ring"):
        extract.set_staging("pinned")
    _capture(writer, "a", tmp_path)
    with pytest.raises(RuntimeError, match="1 part"):
        extract.set_staging("ring")
    writer.submit("commit", ("a", False))
    assert extract.set_staging("ring") == "ring" and extract.memory()["staging"] == "ring"
    writer.host.ring = host_memory.PinnedRing(4096, pin=False)
    writer.host.ring.take(torch.Size([8]), torch.float32, step=1)
    with pytest.raises(RuntimeError, match="its host memory holds rows"):
        extract.set_staging("pool")
    writer.host.ring.give(1)
    assert extract.set_staging("pool") == "pool" and writer.host.ring is None


def test_generated_rows_sort_by_prompt_then_position_each_position_once():
    """Generated tokens' rows arrive one block per step; a recompute after a preemption runs a prompt and its
    generated tokens again in one step: each position is kept once, from the first step that ran it, and a
    prompt's own positions are left to its prompt entry."""
    def block(rows, fill):  # rows: (prompt index, position, token)
        index, position, ids = (torch.tensor(c, dtype=torch.int64) for c in zip(*rows))
        return extract_rows.DecodeBlock(index, position, ids, {"m": torch.full((len(rows), 2), float(fill))})

    blocks = [
        block([(1, 3, 13), (0, 3, 3)], 1),
        block([(1, 4, 14), (0, 4, 4)], 2),
        block([(0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3), (0, 4, 4), (0, 5, 5)], 3),  # 0's recompute: 5 is new
        block([(0, 5, 5), (0, 6, 6), (1, 5, 15)], 4),  # 5 again: dropped
    ]
    got = extract_rows.generated_rows(blocks, prompt_lengths={0: 3, 1: 3})
    assert got["index"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert got["position"].tolist() == [3, 4, 5, 6, 3, 4, 5]
    assert got["token_ids"].tolist() == [3, 4, 5, 6, 13, 14, 15]
    assert got["m"][:, 0].tolist() == [1, 2, 3, 4, 1, 2, 4]
    assert extract_rows.generated_rows([], {}) is None
    # a dataset's indices (a part of prompts 5,000,000 and 5,000,001): the same rows
    far = [extract_rows.DecodeBlock(b.index + 5_000_000, b.position, b.ids, b.values) for b in blocks]
    again = extract_rows.generated_rows(far, prompt_lengths={5_000_000: 3, 5_000_001: 3})
    assert (again["index"] - 5_000_000).tolist() == got["index"].tolist()
    assert again["position"].tolist() == got["position"].tolist()
    # the whole part: each prompt's 3 rows, then its generated ones; 6 captured rows replayed, not written
    prompts = [(i, 0, [0, 1, 2], {"m": torch.zeros(3, 2)}) for i in (1, 0)]
    columns, order, counts, locations, replayed = extract_rows.part_columns(prompts, blocks)
    assert order == [0, 1] and counts == [7, 6] and locations == ["m"] and replayed == 6
    assert torch.cat(columns["position"]).tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]


def test_decode_rows_take_their_tokens_from_the_step_and_are_written_at_their_positions(tmp_path, monkeypatch):
    """``generated``: a prompt's step, then decode steps whose tokens are the forward's own input ids."""
    from safetensors.torch import load_file

    writer = extract.Writer(0, 1, True)
    monkeypatch.setattr(extract, "_writer", writer)
    spec = {"part": "g", "index": 4, "dir": str(tmp_path), "locations": ["m.output"], "generated": True}
    other = dict(spec, index=2)
    prompt = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    writer.submit("capture", extract.StepCapture(range(0, 3), [("a", 0, 3, [7, 8, 9], spec, 0)], None,
                                                 values={"m.output": prompt}))
    for step, (token, other_token) in enumerate([(21, 31), (22, 32)]):
        decode = torch.tensor([[100.0 + step, 0.0], [200.0 + step, 0.0]])
        writer.submit("capture", extract.StepCapture(
            range(0, 2), [("a", 0, 1, None, spec, 3 + step), ("b", 1, 1, None, other, 5 + step)], None,
            values={"m.output": decode}, wants_ids=True, ids=torch.tensor([token, other_token], dtype=torch.int32)))
    written = writer.submit("commit", ("g", False))
    assert written["rows"] == 7 and written["prompts"] == {2: 2, 4: 5} and written["replayed"] == 0
    data = load_file(str(tmp_path / "g.safetensors"))
    assert data["prompt_index"].tolist() == [2, 2, 4, 4, 4, 4, 4]
    assert data["position"].tolist() == [5, 6, 0, 1, 2, 3, 4]
    assert data["token_ids"].tolist() == [31, 32, 7, 8, 9, 21, 22]
    assert data["m.output"][:, 0].tolist() == [200, 201, 0, 2, 4, 100, 101]


def test_a_decode_step_gives_its_slab_back_once_filed(tmp_path, monkeypatch):
    """Generated tokens' rows are copied out of the step's slab when filed: a slab is as large as the
    largest step, and one held per decode step until the commit would drain the pool in a few steps."""
    from safetensors.torch import load_file

    writer = _pool_writer(monkeypatch, slabs=3)
    spec = {"part": "g", "index": 0, "dir": str(tmp_path), "locations": ["m.output"], "generated": True}
    prompt = extract.StepCapture(range(0, 4), [("r", 0, 4, [1, 2, 3, 4], spec, 0)], None, step=1)
    prompt.values["m.output"] = writer.to_host(torch.arange(8.0).reshape(4, 2), prompt)
    writer.submit("capture", prompt)
    del prompt
    assert writer.host.slabs.lent() == 1  # the prompt's rows stay in their slab until the commit
    for step in range(6):  # more decode steps than the pool has slabs
        decode = extract.StepCapture(range(0, 1), [("r", 0, 1, None, spec, 4 + step)], None, step=2 + step,
                                     wants_ids=True, ids=torch.tensor([10 + step], dtype=torch.int32))
        decode.values["m.output"] = writer.to_host(torch.full((1, 2), 100.0 + step), decode)
        writer.submit("capture", decode)
        del decode
        assert writer.host.slabs.lent() == 1
    assert writer.submit("commit", ("g", False))["rows"] == 10
    assert writer.host.slabs.lent() == 0 and writer.host.overflows == 0
    data = load_file(str(tmp_path / "g.safetensors"))
    assert data["token_ids"].tolist() == [1, 2, 3, 4, 10, 11, 12, 13, 14, 15]
    assert data["m.output"][:, 0].tolist() == [0, 2, 4, 6, 100, 101, 102, 103, 104, 105]


def test_locations_extraction_cannot_keep_are_refused_before_a_prompt_is_sent():
    import pytest

    from nnsight_ray.errors import RequestError

    modules = ("", "model", "model.layers", "model.layers.0", "model.layers.1", "model.layers.1.mlp")
    extract.check_locations(["model.layers.1.output", "model.layers.1.mlp.output"], modules)
    extract.check_locations(["model.layers.9.output"], None)  # nothing known of the model: only the form
    for locations, needle in ((["model.layers.1.input"], "is not '<module>.output'"),
                              (["output"], "is not '<module>.output'"),
                              ([], "at least one location"),
                              (["model.layers.9.output"], "'model.layers' has no submodule '9' (its children: 0, 1)"),
                              (["model.layers.1.attn.output"], "'model.layers.1' has no submodule 'attn' "
                                                               "(its children: mlp)"),
                              (["decoder.output"], "the model has no submodule 'decoder' (its children: model)")):
        with pytest.raises(RequestError, match=re.escape(needle)):
            extract.check_locations(locations, modules)


def test_a_cuda_step_sizes_the_hosts_staging_by_the_locations_its_requests_ask_for(monkeypatch):
    """The step plan on a CUDA rank (ring or pool staging) with a prompt and a decoding request in one step:
    the host's staging is sized for the distinct locations this rank captures (found on the H200 in session
    29: a decode entry's extra field broke this path, which no CPU run takes)."""
    from types import SimpleNamespace

    sized = []
    host = SimpleNamespace(mode="pool", ensure_slabs=lambda largest, count: sized.append((largest, count)))
    monkeypatch.setattr(extract, "writer", lambda: SimpleNamespace(host=host))
    monkeypatch.setattr(extract, "row_index", lambda spans, device: spans)  # no CUDA here

    class Runner(extract.ExtractRunnerMixin):
        device = "cuda"
        input_batch = SimpleNamespace(req_ids=["prompt", "decoding", "plain"])
        requests = {"decoding": SimpleNamespace(num_computed_tokens=7)}
        model_config = SimpleNamespace(get_hidden_size=lambda: 16, dtype=torch.float16)
        scheduler_config = SimpleNamespace(max_num_batched_tokens=32)

    runner = Runner()
    runner._extract_steps = 0
    runner._extract_hooks = {"model.layers.0.output": object(), "model.layers.1.output": object(),
                             "model.layers.9.output": None}  # another stage's layer: not captured here
    runner._extract_generating = {"decoding": {"locations": ["model.layers.1.output"], "generated": True}}
    prompt = SimpleNamespace(prompt_token_ids=[1, 2, 3])
    asking = {"prompt": (prompt, {"locations": ["model.layers.0.output", "model.layers.9.output"]})}
    scheduled = SimpleNamespace(num_scheduled_tokens={"prompt": 3, "decoding": 1, "plain": 1})
    runner._extract_plan(scheduled, asking, {"decoding"})
    step = runner._extract_step
    assert [r[:4] for r in step.requests] == [("prompt", 0, 3, [1, 2, 3]), ("decoding", 3, 1, None)]
    assert step.requests[1][5] == 7 and step.wants_ids and step.rows == [(0, 3), (3, 1)]
    assert sized == [(32 * 16 * 2, 2)]  # a full batch of fp16 rows, for layers 0 and 1
