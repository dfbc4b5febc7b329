"""``_internal/block_names.py`` on nnsight's real Mediator deserialization (no engine)."""

from __future__ import annotations

import linecache

from nnsight.intervention.interleaver import Mediator
from nnsight.tracing import globals as nnsight_globals

from nnsight_ray._internal.block_names import forget, rename

SOURCE = "def inner():\n    return 1\nx = inner()\n"


def received() -> Mediator:
    """A block as a rank gets it: nnsight's __setstate__ names it <edit-{id}>."""
    mediator = Mediator.__new__(Mediator)
    mediator.__setstate__({"reduced": (SOURCE, {}, {}), "copy": False, "presaved": set()})
    return mediator


def test_rename_gives_every_block_a_name_of_its_own_with_its_source():
    names = set()
    for _ in range(300):
        mediator = received()
        old = mediator.code.co_filename
        assert old.startswith("<edit-")
        new = rename(mediator)
        names.add(new)
        assert mediator.code.co_filename == new
        inner = next(c for c in mediator.code.co_consts if hasattr(c, "co_filename"))
        assert inner.co_filename == new  # nested code objects too
        assert "".join(linecache.cache[new][2]) == SOURCE
        assert old not in linecache.cache
        forget(new)
    assert len(names) == 300


def test_forget_removes_only_its_own_entries():
    mediator = received()
    name = rename(mediator)
    nnsight_globals.SOURCES[name] = SOURCE
    nnsight_globals.BLOCKS[(name, 3, "<module>", 1)] = (None, None)
    nnsight_globals.BLOCKS[("other.py", 3, "<module>", 1)] = (None, None)
    forget(name)
    assert name not in linecache.cache and name not in nnsight_globals.SOURCES
    assert not any(k[0] == name for k in nnsight_globals.BLOCKS)
    assert ("other.py", 3, "<module>", 1) in nnsight_globals.BLOCKS
    del nnsight_globals.BLOCKS[("other.py", 3, "<module>", 1)]


def test_a_block_that_was_not_received_is_left_alone():
    mediator = Mediator(compile("x = 1", "user.py", "exec"), {}, {})
    assert rename(mediator) is None and mediator.code.co_filename == "user.py"

