"""What a benchmark run prints beside its times: resident memory, kernel choices, cProfile, py-spy, vLLM's profiler.

Every function here runs outside the timed region of a run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .workloads import Bench


def kernel_choices(summary: dict[str, str]) -> dict[str, str]:
    """Which kernels an engine's resolved config asks for (custom ops, each IR op's priority): resolved where
    the config is built, which for RayVLLM is the engine actor, not the rank that runs them."""
    return {key.rsplit(".", 1)[-1]: value for key, value in summary.items()
            if key == "compilation_config.custom_ops" or key.startswith("kernel_config.ir_op_priority.")}


def resident() -> dict[str, float]:
    """Resident memory (MB) of every process of the engine (``engine_processes``), largest first."""
    import psutil

    found = {}
    for pid, name in engine_processes().items():
        try:
            found[f"{name.rsplit('>', 1)[-1][:24]}:{pid}"] = psutil.Process(pid).memory_info().rss / 1e6
        except psutil.Error:
            continue
    return dict(sorted(found.items(), key=lambda kv: -kv[1])[:8])


def profile(bench: Bench, top: int, workloads: list[str]) -> None:
    """Each of ``workloads`` (of generate, registered, trace, every-step, cache; default generate and trace) once under
    cProfile: the top functions by own time and by cumulative time.

    Meant for ``--engines local-profile`` (LocalVLLM with vLLM's engine core in
    this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the runner's
    work is in the profile too.
    """
    import cProfile
    import io
    import pstats

    for workload in [w for w in workloads if w in ("generate", "registered", "trace", "every-step", "cache")] or ["generate", "trace"]:
        profiler = cProfile.Profile()
        profiler.enable()
        getattr(bench, "run_" + workload.replace("-", "_"))()
        profiler.disable()
        bench.after_run()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        print(f"\nPROFILE {bench.engine} {workload} ({len(bench.texts)} prompts x {bench.args.tokens} tokens)\n"
              + out.getvalue(), flush=True)


def kernel_profile(bench: Bench, args: argparse.Namespace) -> None:
    """One run of each of ``--kernel-profile-workloads`` under vLLM's own worker profiler (torch.profiler on
    every rank: CPU and device activity); vLLM writes each worker's table, sorted by device time, and its
    trace to ``--kernel-profile``/<engine>/. The table's top rows are printed here."""
    for workload in [w for w in args.kernel_profile_workloads.split(",") if w in bench.workloads()]:
        run = getattr(bench, "run_" + workload.replace("-", "_"))
        bench.before(workload)()
        entry = bench.entrypoint()  # plain vLLM's and LocalVLLM's `LLM`, or RayVLLM's engine
        if hasattr(entry, "start_profile"):
            entry.start_profile(profile_prefix=workload)
        else:
            entry.collective_rpc("profile", args=(True, workload))
        began = time.perf_counter()
        run()
        took = time.perf_counter() - began
        bench.after_run()
        if hasattr(entry, "start_profile"):
            entry.stop_profile()
        else:
            entry.collective_rpc("profile", args=(False,))
        print(f"\nKERNELS {bench.engine} {workload}: one run under the profiler, {took:.2f} s", flush=True)
        for table in sorted((Path(args.kernel_profile) / bench.engine).glob(f"{workload}*profiler_out.txt")):
            lines = table.read_text().splitlines()
            print(f"[{table.name}]\n" + "\n".join(lines[:args.spy_top + 4] + lines[-3:]), flush=True)


def engine_processes() -> dict[int, str]:
    """Every process an engine runs in: this one, its children (vLLM's engine core), and Ray's actors
    with their children (the engine actor's engine core), by pid -> a short name."""
    import psutil

    found: dict[int, str] = {}

    def add(proc, name: str) -> None:
        found.setdefault(proc.pid, name)
        for kid in proc.children(recursive=True):
            try:
                kid_name = " ".join(kid.cmdline()[:1])[:40] or kid.name()
            except psutil.Error:
                continue
            found.setdefault(kid.pid, f"{name}>{kid_name}")

    add(psutil.Process(), "bench")
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if cmd.startswith("ray::") and "IDLE" not in cmd:
            add(proc, cmd.split()[0][5:])
    return found


def spy_summary(raw: Path, top: int) -> str:
    """A py-spy raw profile as its top frames by own samples and by inclusive samples."""
    import collections

    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        count, frames = int(count), stack.split(";")
        total += count
        names = [f.split(" (")[0] + " (" + f.rsplit("/", 1)[-1] if " (" in f else f for f in frames]
        own[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
    if not total:
        return "  (no samples)"
    lines = [f"  {total} samples; own:"] + [f"  {v / total:6.1%} {k}" for k, v in own.most_common(top)]
    lines += ["  inclusive:"] + [f"  {v / total:6.1%} {k}" for k, v in inclusive.most_common(top)]
    return "\n".join(lines)


def spy(bench: Bench, args: argparse.Namespace) -> None:
    """Each of ``--spy-workloads`` in a loop for ``--spy`` seconds, with py-spy sampling every process
    of the engine (the engine core, and on RayVLLM the engine, merge and rank actors): where each
    process spends its time, printed per process; the raw profiles go to ``--spy-dir``."""
    import shutil

    binary = shutil.which("py-spy") or args.spy_bin
    if not binary or not Path(binary).exists():
        print("[spy] no py-spy binary (pass --spy-bin)", flush=True)
        return
    out = Path(args.spy_dir or tempfile.mkdtemp(prefix="spy-"))
    out.mkdir(parents=True, exist_ok=True)
    for workload in [w for w in args.spy_workloads.split(",") if w in bench.workloads()]:
        run = getattr(bench, "run_" + workload.replace("-", "_"))
        before = bench.before(workload)
        only = [n for n in args.spy_only.split(",") if n]
        procs = {pid: name for pid, name in engine_processes().items() if not only or any(n in name for n in only)}
        spies = []
        for pid, name in procs.items():
            raw = out / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{bench.engine}-{workload}-{name}-{pid}.txt")
            spies.append((name, raw, subprocess.Popen(
                [binary, "record", "-p", str(pid), "-o", str(raw), "-f", "raw", "-r", "250",
                 "-d", str(int(args.spy)), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(1.0)  # py-spy attaches
        runs, until = [], time.perf_counter() + args.spy - 2.0
        while time.perf_counter() < until:
            before()  # as the measured runs (shards: an empty folder, not renames over the last run's files)
            began = time.perf_counter()
            run()
            runs.append(time.perf_counter() - began)
            bench.after_run()
        for _, _, proc in spies:
            proc.wait()
        print(f"\nSPY {bench.engine} {workload}: {len(runs)} runs under py-spy, "
              f"{', '.join(f'{t:.2f}' for t in runs)} s", flush=True)
        for name, raw, _ in spies:
            if raw.exists():
                print(f"[{name}] {raw.name}\n{spy_summary(raw, args.spy_top)}", flush=True)
