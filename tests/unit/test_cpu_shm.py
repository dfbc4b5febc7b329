"""The CPU worker's clean-up of vLLM's shared-memory segments (names only, no engine)."""

from __future__ import annotations

import pytest

from nnsight_ray._internal.ranks import cpu_worker


@pytest.mark.parametrize(
    "init_method, ident",
    [("tcp://127.0.0.1:36201", "36201"), ("tcp://[::1]:5000", "5000"), ("file:///tmp/dist/abc", "abc")],
)
def test_dist_ident_matches_vllm(init_method, ident):
    assert cpu_worker._dist_ident(init_method) == ident


def test_unlink_takes_only_this_prefix_and_only_vllm_segments(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_worker, "_SHM_DIR", str(tmp_path))
    names = [
        "36201-tp:0-[0-1]-cpushm_0",  # this engine's leftovers: go
        "36201-pp:0-[0-2]-cpushm_1",
        "362011-tp:0-[0-1]-cpushm_0",  # another port sharing the digits: stays
        "4000-tp:0-[0-1]-cpushm_0",  # another engine: stays
        "36201-not-vllm",  # not a vLLM CPU segment: stays
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    cpu_worker._unlink_shm("36201-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_unlink_without_shm_dir_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_worker, "_SHM_DIR", str(tmp_path / "missing"))
    cpu_worker._unlink_shm("1-")
