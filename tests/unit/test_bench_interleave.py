"""``python -m benchmarks.gpu --interleave``: every engine's process alive at once, their runs taken in turn (real child
processes speaking the bench's turn protocol; no engine)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, time
import benchmarks.gpu as bench
folder, tag, runs, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if runs < 0:
    sys.exit(3)  # an engine that fails to start
turn = bench.Turns(folder, tag)
for k in range(runs):
    with turn("generate"):
        with open(log, "a") as f:
            f.write(f"{{tag}}.{{k}} start\\n")
        time.sleep(0.02)  # a run: nobody else's may start meanwhile
        with open(log, "a") as f:
            f.write(f"{{tag}}.{{k}} end\\n")
"""


def test_runs_alternate_one_at_a_time_and_a_failed_or_shorter_engine_does_not_hold_the_others(bench_gpu, tmp_path):
    log = tmp_path / "log"
    code = CHILD.format()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    children = [(tag, [sys.executable, "-c", code, str(tmp_path), tag, str(runs), str(log)], env, None)
                for tag, runs in (("e0", 3), ("bad", -1), ("e1", 2))]
    codes = bench_gpu.interleave(children, tmp_path, deadline_s=60)
    assert codes == {"e0": 0, "bad": 3, "e1": 0}
    lines = log.read_text().splitlines()
    order = ["e0.0", "e1.0", "e0.1", "e1.1", "e0.2"]  # run k of each before run k+1 of any
    assert lines == [f"{run} {edge}" for run in order for edge in ("start", "end")]  # never overlapping


def test_without_turns_a_run_waits_for_nothing(bench_gpu):
    turn = bench_gpu.Turns(None, None)
    with turn("generate"):
        pass
    assert turn.k == 0


def test_a_workload_is_compared_with_the_floor_runs_taken_beside_it(bench_gpu, capsys):
    """Interleaved, plain eager runs generate beside the trace's runs ("generate@trace"); the trace's ratio
    uses those, and a workload without such runs uses plain generate's own."""
    from types import SimpleNamespace

    def got(rate):
        return {"tokens_per_s": rate, "tokens": rate, "seconds": [1.0], "saved_mb_per_s": 0.0}

    results = {"vllm-eager": {"workloads": {"generate": got(100.0), "generate@trace": got(50.0)}},
               "ray": {"workloads": {"generate": got(90.0), "trace": got(45.0), "registered": got(80.0)}}}
    args = SimpleNamespace(arch="llama", dtype="float32", prompts=4, tokens=2, extract_prompts=1, extract_len=8,
                           repeats=1, interleave=True, device="CPU")
    rows = {(r["engine"], r["workload"]): r for r in bench_gpu.table(results, args)}
    assert rows["ray", "trace"]["vs_eager"] == pytest.approx(0.9)  # 45 / 50, not 45 / 100
    assert rows["ray", "registered"]["vs_eager"] == pytest.approx(0.8)
    assert rows["ray", "generate"]["vs_eager"] == pytest.approx(0.9)
    assert "generate@trace" in capsys.readouterr().out
    assert rows["ray", "trace"]["vs_generate"] == pytest.approx(0.5) and rows["ray", "generate"]["vs_generate"] is None


def test_interleaved_ratios_are_medians_of_per_turn_pairs_and_apart_they_are_brackets(bench_gpu, capsys):
    """The host drifts: turn 1 fast, turn 3 slow. Per-turn pairs see the same drift and give the trace's
    0.9x every time; the ratio of the two medians mixes turns and says otherwise."""
    from types import SimpleNamespace

    def got(seconds):
        return {"tokens_per_s": 100 / sorted(seconds)[1], "tokens": 100, "seconds": seconds, "saved_mb_per_s": 0.0}

    results = {"ray": {"workloads": {"generate": got([0.9, 1.0, 2.0]), "trace": got([1.0, 1.2, 2.0 / 0.9])}}}
    args = SimpleNamespace(arch="llama", dtype="float32", prompts=4, tokens=2, extract_prompts=1, extract_len=8,
                           repeats=3, interleave=True, device="CPU")
    rows = {(r["engine"], r["workload"]): r for r in bench_gpu.table(results, args)}
    assert rows["ray", "trace"]["vs_generate"] == pytest.approx(0.9, abs=1e-3)  # 0.9, 0.833, 0.9: median 0.9
    assert "per-turn pairs" in capsys.readouterr().out
    apart = bench_gpu.table(results, SimpleNamespace(**{**vars(args), "interleave": False}))
    trace = next(r for r in apart if r["workload"] == "trace")
    assert trace["vs_generate"] == pytest.approx(1.0 / 1.2)  # ratio of medians
    assert "brackets" in capsys.readouterr().out
