"""``--interleave``: every engine's child alive at once, their runs taken in turn (files in a shared folder)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Iterator

from .schedstat import Schedstat


class Turns:
    """``--interleave``, in a child: each run (warm-up or timed) waits for the parent's go.

    Before a run the child writes ``TAG.K.ready`` (K counts its runs; the file holds the workload) and waits
    for ``TAG.K.go``; after it, and after the run's untimed timeline, ``TAG.K.done``. Without ``--turns`` a
    turn is free."""

    def __init__(self, folder: str | None, tag: str | None) -> None:
        self.folder, self.tag, self.k = (Path(folder) if folder else None), tag, 0

    @contextlib.contextmanager
    def __call__(self, workload: str) -> Iterator[None]:
        if self.folder is None:
            yield
            return
        stem = self.folder / f"{self.tag}.{self.k}"
        Path(f"{stem}.ready").write_text(workload)
        while not Path(f"{stem}.go").exists():
            time.sleep(0.005)
        try:
            yield
        finally:
            Path(f"{stem}.done").touch()
            self.k += 1


def interleave(children: list[tuple[str, list[str], dict, str | None]], folder: Path, deadline_s: float,
               watch: Schedstat | None = None, settle_s: float = 0.0) -> dict:
    """``--interleave``: every engine's process alive at once, each run of each in turn.

    The children start one after another (each start alone, timed in the child, as without it); then, round
    after round, each live child runs its next run (a warm-up or a timed run of its next workload) while
    the others wait between runs: drift of a shared GPU over minutes hits every row alike. ``watch``: the
    host's thread times read around every turn (``--schedstat``). ``settle_s``: the pause after every
    turn before the next one's go (``--settle``: vLLM's shared-memory readers, a worker waiting for its
    next step and the engine core waiting for its workers' outputs, spin on a core for a second after
    their last read; without the pause a turn shares the cores with the turn before it). Returns each
    engine's exit code (``"timeout"`` past ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s
    procs, codes, runs = {}, {}, {}

    def wait_for(tag: str, suffix: str) -> bool:  # False: the child ended (or the deadline passed) first
        path = folder / f"{tag}.{runs[tag]}.{suffix}"
        while not path.exists():
            if procs[tag].poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    for tag, command, env, cwd in children:
        procs[tag], runs[tag] = subprocess.Popen(command, env=env, cwd=cwd), 0
        wait_for(tag, "ready")  # started (or failed to): the next one starts alone
    live = [tag for tag, *_ in children]
    while live:
        for tag in list(live):
            if not wait_for(tag, "ready"):
                live.remove(tag)
                continue
            if watch:
                watch.begin()
            (folder / f"{tag}.{runs[tag]}.go").touch()
            if not wait_for(tag, "done"):
                live.remove(tag)
                continue
            if watch:  # by row and workload (the ready file names the run's workload)
                workload = (folder / f"{tag}.{runs[tag]}.ready").read_text()
                watch.end(tag, {proc.pid: name for name, proc in procs.items()}, workload)
            time.sleep(settle_s)
            runs[tag] += 1
    for tag, proc in procs.items():
        try:
            codes[tag] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[tag] = "timeout"
    return codes
