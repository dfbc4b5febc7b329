"""nnsight's ``.save`` mount must not break anyio classes Serve defines later."""

from __future__ import annotations

import subprocess
import sys

CHECK = (
    "import {first}, nnsight\n"
    "from anyio.abc import SocketAttribute\n"
    "import anyio.streams.file, anyio.streams.tls\n"
)


def _run(first: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK.format(first=first)], capture_output=True, text=True,
                          timeout=300)


def test_importing_nnsight_ray_first_keeps_anyio_attribute_sets_definable():
    done = _run("nnsight_ray")
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_failure_it_guards_against_is_real():
    """Without the package's warm-up, nnsight 0.8.1 + lazy anyio fail (the Serve controller did in CI)."""
    done = _run("sys")
    assert done.returncode != 0 and "Attribute 'save' is missing its type annotation" in done.stderr
