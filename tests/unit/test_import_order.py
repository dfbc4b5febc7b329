"""nnsight's ``.save`` mount must not break anyio classes Serve defines later, in either import order."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = (
    "{imports}\n"
    "from anyio.abc import SocketAttribute\n"
    "import anyio.streams.file, anyio.streams.tls\n"
    "import torch\n"
    "assert torch.ones(1).save is not None  # nnsight's mount is still there\n"
)


def _run(imports: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK.format(imports=imports)], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("imports", ["import nnsight_ray, nnsight", "import nnsight, nnsight_ray"],
                         ids=["nnsight_ray-first", "nnsight-first (a reused Ray worker)"])
def test_anyio_attribute_sets_stay_definable_with_nnsight_loaded(imports):
    done = _run(imports)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_failure_it_guards_against_is_real():
    """Without the package, nnsight 0.8.1 + lazy anyio fail (a Serve replica did in CI)."""
    done = _run("import nnsight")
    assert done.returncode != 0 and "Attribute 'save' is missing its type annotation" in done.stderr
