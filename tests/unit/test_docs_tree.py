"""docs/architecture.md's package tree is the package: every ``.py`` file, no more, no fewer.

The tree is the first fenced block under "## Package layout": one entry per
line, two spaces of indent per level, a folder ending in ``/``, then an
optional description.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def tree_files(text: str) -> set[str]:
    """The ``.py`` paths a drawn tree names."""
    section = text.split("## Package layout", 1)[1]
    block = section.split("```", 2)[1]
    stack: list[str] = []
    files = set()
    for line in block.split("\n"):
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        del stack[depth:]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
        elif name.endswith(".py"):
            files.add("/".join(stack + [name]))
    return files


def test_the_tree_reader_follows_indentation():
    drawn = "## Package layout\n```\npkg/\n  a.py    what a is\n  sub/\n    b.py\n  c.py\n```\n"
    assert tree_files(drawn) == {"pkg/a.py", "pkg/sub/b.py", "pkg/c.py"}


def test_architecture_tree_equals_the_package():
    drawn = tree_files(DOC.read_text())
    real = {str(p.relative_to(ROOT)) for p in (ROOT / "nnsight_ray").rglob("*.py")}
    missing, extra = sorted(real - drawn), sorted(drawn - real)
    if missing or extra:
        pytest.fail("docs/architecture.md's tree differs from the package: "
                    f"not drawn {missing}; drawn but absent {extra}")
