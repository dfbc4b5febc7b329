"""One engine's child process: start it, run each workload (a warm-up, then ``--repeats`` timed runs), write the JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .diagnostics import kernel_profile, profile, spy
from .turns import Turns
from .workloads import Bench


def child(args: argparse.Namespace) -> None:
    """Run one engine's workloads; write the JSON after each one (partial results survive a timeout)."""
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
    for workload in bench.workloads():
        base = workload.split("@")[0]  # "generate@trace": a plain row's floor run beside trace (--interleave)
        run = getattr(bench, "run_" + base.replace("-", "_"))
        try:
            before = bench.before(base)
            with turn(workload):
                before()
                run()  # warm-up (and the first check)
                bench.after_run()
            modes_before = bench.step_modes()
            times, amounts, timelines = [], None, []
            for _ in range(args.repeats):
                with turn(workload):
                    before()
                    began, mono = time.perf_counter(), time.monotonic()
                    amounts = run()
                    times.append(time.perf_counter() - began)
                    timelines.append(bench.timeline(mono, time.monotonic()))  # untimed, between runs
                    bench.after_run()
            timeline = timelines[-1]
            slowest = max(range(len(times)), key=times.__getitem__)
            median = statistics.median(times)
            tokens, saved = amounts
            modes = {k: v - modes_before.get(k, 0) for k, v in bench.step_modes().items()}
            result["workloads"][workload] = {"seconds": times, "median_s": median, "tokens": tokens,
                                             "tokens_per_s": tokens / median, "saved_bytes": saved,
                                             "saved_mb_per_s": saved / median / 1e6,
                                             "step_modes": {k: v for k, v in modes.items() if v}}
            print(f"[{args.child}] {workload}: {tokens / median:,.0f} tok/s (runs {', '.join(f'{t:.2f}' for t in times)} s)"
                  f"{' steps ' + str(result['workloads'][workload]['step_modes']) if modes else ''}", flush=True)
            if timeline:
                result["workloads"][workload]["timeline"] = timeline
                print(f"[{args.child}] {workload} last run, ms: {timeline}", flush=True)
            if timelines[slowest] and slowest != len(times) - 1:  # the outlier's story (seen on an H200: run 3
                # of 5, ~0.4 s slower, in every RayVLLM row)
                result["workloads"][workload]["slowest_timeline"] = timelines[slowest]
                print(f"[{args.child}] {workload} slowest run ({slowest + 1} of {len(times)}), ms: {timelines[slowest]}",
                      flush=True)
        except Exception as error:
            result["errors"][workload] = f"{type(error).__name__}: {error}"
            print(f"[{args.child}] {workload} FAILED: {type(error).__name__}: {error}", flush=True)
        out.write_text(json.dumps(result))
    if args.profile:
        profile(bench, args.profile, args.workloads.split(","))
    if args.kernel_profile:
        kernel_profile(bench, args)
    if args.spy:
        spy(bench, args)
    bench.stop()
