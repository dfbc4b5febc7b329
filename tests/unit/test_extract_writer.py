"""The extraction writer's memory hand-back (``_internal/extract.Writer``), on CPU tensors (no engine)."""

from __future__ import annotations

import time
import weakref

import torch

from nnsight_ray._internal import extract


def test_an_idle_writer_returns_pinned_memory_after_the_rows_are_freed(tmp_path, monkeypatch):
    """Pinned blocks go back only once nothing holds them: the part's rows are freed before the release."""
    releases = []
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    alive = weakref.ref(rows)
    monkeypatch.setattr(extract, "release_pinned_cache", lambda: releases.append(alive() is None))
    writer = extract.Writer(0, 1, True)
    writer.idle_after_s = 0  # at once
    spec = {"part": "p0", "index": 0, "dir": str(tmp_path), "locations": ["model.layers.0.output"]}
    step = extract.StepCapture(torch.arange(6), [("r0", 0, 6, list(range(6)), spec)], None,
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
        writer.submit("capture", extract.StepCapture(torch.arange(2), [("r", 0, 2, [1, 2], spec)], None,
                                                     values={"x.output": torch.ones(2, 3)}))
    writer.submit("commit", ("a", False))
    assert releases == []  # part b is still held
    writer.submit("commit", ("b", False))
    assert releases == [1]


def _capture(writer, part, tmp_path):
    spec = {"part": part, "index": 0, "dir": str(tmp_path), "locations": ["x.output"]}
    writer.submit("capture", extract.StepCapture(torch.arange(2), [("r", 0, 2, [1, 2], spec)], None,
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
    assert extract.row_index([(0, 3), (3, 4), (7, 2)], "cpu") == range(0, 9)
    assert extract.row_index([(5, 2)], "cpu") == range(5, 7)
    gapped = extract.row_index([(0, 2), (5, 3)], "cpu")
    assert isinstance(gapped, torch.Tensor) and gapped.tolist() == [0, 1, 5, 6, 7]
    hidden, residual = torch.randn(12, 4), torch.randn(12, 4)
    for spans in ([(2, 3), (5, 4)], [(0, 2), (5, 3)]):
        rows = [r for a, n in spans for r in range(a, a + n)]
        want = hidden[rows] + residual[rows]
        got = extract.capture((hidden, residual), extract.row_index(spans, "cpu"))
        assert torch.equal(got, want)
        alone = extract.capture(hidden, extract.row_index(spans, "cpu"))
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
    assert extract.memory() == {"parts": 0, "writing": 0}  # no CUDA here: no pinned figures
