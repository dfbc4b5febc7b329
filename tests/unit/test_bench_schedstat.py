"""``python -m benchmarks.gpu --interleave --settle S --schedstat N``: a row that keeps a core busy after its turn
(as vLLM's shared-memory readers spin for a second after their last read) is seen in the next row's turn, and a
pause between turns keeps it out (real child processes speaking the bench's turn protocol; no engine)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, time
import benchmarks.gpu as bench
folder, tag, runs, spin = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
turn = bench.Turns(folder, tag)
for k in range(runs):
    with turn("generate"):
        time.sleep(0.3)  # a run that waits (a model on another core)
    end = time.monotonic() + spin  # after the turn: a reader spinning on its queue
    while time.monotonic() < end:
        pass
"""


def run(bench_gpu, tmp_path: Path, settle_s: float):
    tmp_path.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    children = [(tag, [sys.executable, "-c", CHILD, str(tmp_path), tag, "2", spin], env, None)
                for tag, spin in (("spinner", "0.25"), ("quiet", "0"))]
    watch = bench_gpu.Schedstat()
    assert bench_gpu.interleave(children, tmp_path, deadline_s=60, watch=watch, settle_s=settle_s) == {
        "spinner": 0, "quiet": 0}
    return watch


def ran_ms(watch, row: str, whose: str) -> float:
    """Milliseconds per turn that ``whose``'s threads ran during ``row``'s turns."""
    turns = watch.turns[f"{row} generate"]
    return sum(ran for (owner, *_), (ran, _) in watch.rows[f"{row} generate"].items() if owner == whose) / turns / 1e6


def test_a_row_spinning_after_its_turn_is_seen_in_the_next_rows_turn_and_a_pause_keeps_it_out(bench_gpu, tmp_path):
    unsettled = run(bench_gpu, tmp_path / "a", settle_s=0.0)
    assert ran_ms(unsettled, "quiet", "spinner") > 100  # 250 ms of spinning, most of it in the quiet row's 300 ms
    report = unsettled.report({"spinner": "row-a", "quiet": "row-b"}, top=5)
    assert "[schedstat] row-b generate: 2 turns" in report and "row-a" in report
    settled = run(bench_gpu, tmp_path / "b", settle_s=0.5)
    assert ran_ms(settled, "quiet", "spinner") < 20
    assert ran_ms(settled, "spinner", "own") < 50  # a row's turn is its own: a sleeping run uses no core


def test_threads_belong_to_the_row_whose_child_they_descend_from(bench_gpu):
    from benchmarks.gpu.schedstat import owner

    procs = {10: (1, "bench"), 20: (10, "child e0"), 30: (20, "raylet"), 40: (30, "ray::Rank"), 50: (1, "kdamond")}
    roots = {20: "e0"}
    assert owner(40, procs, roots) == "e0" and owner(20, procs, roots) == "e0"
    assert owner(50, procs, roots) == "host" and owner(99, procs, roots) == "host"
