"""Unit tests are pure logic: none of them may start or join a Ray cluster.

This module and ``tests/conftest.py`` are both imported as ``conftest`` (no
packages here), and the one collected last holds that name. So test modules
take what they need from ``tests/conftest.py`` with a ``from conftest import``
at module level, at collection (as every integration module does), never inside
a function, which would run after this module took the name.
"""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def bench_gpu():
    """``benchmarks.gpu`` (its pure parts: engine arguments, turns, the table), imported from the repository root
    (pytest's ``pythonpath``)."""
    return importlib.import_module("benchmarks.gpu")


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("unit tests must not start or join Ray")

    monkeypatch.setattr(ray, "init", refuse)
