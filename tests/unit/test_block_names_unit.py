"""``_internal/blocks/block_names.py`` on nnsight's real Mediator deserialization (no engine)."""

from __future__ import annotations

import linecache

from nnsight.intervention.interleaver import Mediator
from nnsight.tracing import globals as nnsight_globals

from nnsight_ray._internal.blocks.block_names import forget, rename

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



def test_blocks_from_nnsight_rays_caller_compile_once_per_source_and_count_like_any_other(monkeypatch):
    """``rebuild_mediator`` (what ``shared_blocks`` pickles to): one compile for a trace's 300 invokes."""
    import builtins

    from nnsight_ray._internal.blocks import block_names

    compiled = []
    real_compile = builtins.compile
    monkeypatch.setattr(builtins, "compile", lambda *a, **k: compiled.append(a[1]) or real_compile(*a, **k))
    source = SOURCE + "z = 2\n"
    state = {"reduced": (source, {}, {"k": 1}), "copy": False, "presaved": {"k"}}
    mediators = [block_names.rebuild_mediator(state) for _ in range(300)]
    assert len(compiled) == 1
    names = [rename(m) for m in mediators]
    assert len(set(names)) == 1 and compiled == names[:1]
    theirs = received(source)
    assert rename(theirs) == names[0]  # the same name as nnsight's own deserialization gets
    del compiled[1:]  # nnsight's own compile of `theirs`
    assert type(mediators[0]) is Mediator and mediators[0].presaved == {"k"} and mediators[0].lcls["k"] == 1
    assert "".join(linecache.cache[names[0]][2]) == source
    for name in names + [names[0]]:
        assert name in linecache.cache
        forget(name)
    assert names[0] not in linecache.cache
    again = block_names.rebuild_mediator(state)  # still compiled: the cache outlives the uses
    assert len(compiled) == 1 and rename(again) == names[0] and names[0] in linecache.cache
    forget(names[0])
    assert names[0] not in linecache.cache
