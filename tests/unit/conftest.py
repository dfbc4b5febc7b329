"""Unit tests are pure logic: none of them may start or join a Ray cluster."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("unit tests must not start or join Ray")

    monkeypatch.setattr(ray, "init", refuse)
