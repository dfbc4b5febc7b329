"""``_internal/block_names.py`` on nnsight's real Mediator deserialization (no engine)."""

from __future__ import annotations

import linecache

from nnsight.intervention.interleaver import Mediator
from nnsight.tracing import globals as nnsight_globals

from nnsight_ray._internal.block_names import forget, rename

SOURCE = "def inner():\n    return 1\nx = inner()\n"


def received(source: str = SOURCE) -> Mediator:
    """A block as a rank gets it: nnsight's __setstate__ names it <edit-{id}>."""
    mediator = Mediator.__new__(Mediator)
    mediator.__setstate__({"reduced": (source, {}, {}), "copy": False, "presaved": set()})
    return mediator


def test_blocks_are_named_by_their_source_and_the_name_lives_while_one_uses_it():
    names = []
    for _ in range(300):  # one trace's invokes: one source, many requests
        mediator = received()
        old = mediator.code.co_filename
        assert old.startswith("<edit-")
        names.append(rename(mediator))
        assert mediator.code.co_filename == names[-1]
        inner = next(c for c in mediator.code.co_consts if hasattr(c, "co_filename"))
        assert inner.co_filename == names[-1]  # nested code objects too
        assert old not in linecache.cache
    assert len(set(names)) == 1 and "".join(linecache.cache[names[0]][2]) == SOURCE
    other = received(SOURCE + "y = x\n")
    other_name = rename(other)
    assert other_name != names[0] and "".join(linecache.cache[other_name][2]) == SOURCE + "y = x\n"
    forget(other_name)
    nnsight_globals.SOURCES[names[0]] = SOURCE  # what a nested `with` leaves behind
    for name in names[:-1]:
        forget(name)
        assert name in linecache.cache and name in nnsight_globals.SOURCES  # still in use
    forget(names[-1])
    assert names[0] not in linecache.cache and names[0] not in nnsight_globals.SOURCES
    assert other_name not in linecache.cache


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

