"""One engine's child process: start it, run its workloads in rounds (a warm-up of each, then ``--repeats`` rounds
of one timed run of each), write the JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .diagnostics import kernel_profile, profile, spy
from .turns import Turns
from .workloads import Bench


def summary(engine: str, workload: str, got: dict, last: bool) -> dict:
    """A workload's runs so far: median, rates, step modes; printed (with timelines) after the last round."""
    times, (tokens, saved), timelines = got["times"], got["amounts"], got["timelines"]
    median = statistics.median(times)
    modes = {k: v for k, v in got["modes"].items() if v}
    row = {"seconds": list(times), "median_s": median, "tokens": tokens, "tokens_per_s": tokens / median,
           "saved_bytes": saved, "saved_mb_per_s": saved / median / 1e6, "step_modes": modes}
    if not last:
        return row
    print(f"[{engine}] {workload}: {tokens / median:,.0f} tok/s (runs {', '.join(f'{t:.2f}' for t in times)} s)"
          f"{' steps ' + str(modes) if modes else ''}", flush=True)
    if timelines[-1]:
        row["timeline"] = timelines[-1]
        print(f"[{engine}] {workload} last run, ms: {timelines[-1]}", flush=True)
    slowest = max(range(len(times)), key=times.__getitem__)
    if timelines[slowest] and slowest != len(times) - 1:  # the outlier's story (seen on an H200: run 3 of 5,
        # ~0.4 s slower, in every RayVLLM row)
        row["slowest_timeline"] = timelines[slowest]
        print(f"[{engine}] {workload} slowest run ({slowest + 1} of {len(times)}), ms: {timelines[slowest]}",
              flush=True)
    return row


def child(args: argparse.Namespace) -> None:
    """Run one engine's workloads; write the JSON after each round (partial results survive a timeout)."""
    import torch

    args.on_gpu = torch.cuda.is_available()
    bench = Bench(args, args.child)
    result = {"engine": args.child, "workloads": {}, "errors": {}}
    out = Path(args.child_json)
    try:
        result["start_s"] = bench.start()
    except Exception as error:
        result["errors"]["start"] = f"{type(error).__name__}: {error}"
        out.write_text(json.dumps(result))
        raise
    out.write_text(json.dumps(result))
    turn = Turns(args.turns, args.turn_tag)
    # Rounds: a warm-up of every workload, then ``--repeats`` rounds of one timed run of each. A workload's run k
    # and plain generate's run k are then minutes apart no more (``vs gen`` pairs them), as the rows' runs k are
    # with ``--interleave``.
    runs = {workload: {"times": [], "amounts": None, "timelines": [], "modes": {}} for workload in bench.workloads()}
    for round_ in range(args.repeats + 1):
        for workload, got in list(runs.items()):
            base = workload.split("@")[0]  # "generate@trace": a plain row's floor run beside trace (--interleave)
            run = getattr(bench, "run_" + base.replace("-", "_"))
            try:
                before = bench.before(base)
                with turn(workload):
                    if round_ == 0:
                        before()
                        run()  # warm-up (and the first check)
                        bench.after_run()
                        continue
                    modes_before = bench.step_modes()
                    before()
                    began, mono = time.perf_counter(), time.monotonic()
                    got["amounts"] = run()
                    got["times"].append(time.perf_counter() - began)
                    got["timelines"].append(bench.timeline(mono, time.monotonic()))  # untimed, between runs
                    for mode, count in bench.step_modes().items():
                        got["modes"][mode] = got["modes"].get(mode, 0) + count - modes_before.get(mode, 0)
                    bench.after_run()
            except Exception as error:
                result["errors"][workload] = f"{type(error).__name__}: {error}"
                print(f"[{args.child}] {workload} FAILED: {type(error).__name__}: {error}", flush=True)
                del runs[workload]
        if round_:
            for workload, got in runs.items():
                result["workloads"][workload] = summary(args.child, workload, got, last=round_ == args.repeats)
            out.write_text(json.dumps(result))
    if args.profile:
        profile(bench, args.profile, args.workloads.split(","))
    if args.kernel_profile:
        kernel_profile(bench, args)
    if args.spy:
        spy(bench, args)
    bench.stop()
