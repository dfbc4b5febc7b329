"""Unit tests are pure logic: none of them may start or join a Ray cluster.

This module and ``tests/conftest.py`` are both imported as ``conftest`` (no
packages here), and the one collected last holds that name. So test modules
take what they need from ``tests/conftest.py`` with a ``from conftest import``
at module level, at collection (as every integration module does), never inside
a function, which would run after this module took the name.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH_GPU = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpu.py"


@pytest.fixture(scope="module")
def bench_gpu():
    """``scripts/bench_gpu.py`` loaded as a module (its pure parts: engine arguments, turns, the table)."""
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", BENCH_GPU)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("unit tests must not start or join Ray")

    monkeypatch.setattr(ray, "init", refuse)
