"""The parent: its arguments, one child process per engine (``--interleave``: all at once), then the table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import SETTLE_S
from .schedstat import Schedstat
from .turns import interleave
from .workloads import ENGINES, WORKLOADS, floor_of

def engine_tree(engine: str, trees: list[str]) -> tuple[str, str | None]:
    """``ENGINE@TAG`` -> (ENGINE, the DIR of ``--tree TAG=DIR``); a plain engine name -> (it, None)."""
    if "@" not in engine:
        return engine, None
    base, tag = engine.split("@", 1)
    found = dict(t.split("=", 1) for t in trees if "=" in t)
    if tag not in found:
        raise SystemExit(f"engine {engine}: no --tree {tag}=DIR")
    return base, str(Path(found[tag]).resolve())


def child_skip(skip: str, engine: str, base: str) -> str:
    """``--skip`` for the child of engine row ``engine`` (``ray%cache``, ``ray@old``), which runs as ``base``:
    the pairs that name that row, renamed to ``base``; a pair names one row, so ``ray:prefill`` skips
    the plain ``ray`` row only."""
    return ",".join(f"{base}:{pair.split(':', 1)[1]}" for pair in skip.split(",") if pair.startswith(engine + ":"))


def engine_env(engine: str, settings: list[str]) -> tuple[str, dict[str, str]]:
    """``ENGINE%TAG`` -> (ENGINE, the variables of every ``--env TAG=NAME=VALUE``); a plain name -> (it, {})."""
    if "%" not in engine:
        return engine, {}
    base, tag = engine.rsplit("%", 1)
    found = {}
    for setting in settings:
        mine, _, assignment = setting.partition("=")
        name, equals, value = assignment.partition("=")
        if not equals:
            raise SystemExit(f"--env {setting}: expected TAG=NAME=VALUE")
        if mine == tag:
            found[name] = value
    if not found:
        raise SystemExit(f"engine {engine}: no --env {tag}=NAME=VALUE")
    return base, found


def paired_ratio(got: dict, base: dict) -> float:
    """The median over k of (run k's tokens/s) / (the base's run k's tokens/s): runs taken in turn share the
    host's drift, so each pair's ratio is a measurement where a ratio of two medians is only a bracket."""
    ratios = sorted((got["tokens"] / mine) / (base["tokens"] / theirs)
                    for mine, theirs in zip(got["seconds"], base["seconds"]))
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2


def table(results: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    def found(engine: str, workload: str) -> dict | None:
        return results.get(engine, {}).get("workloads", {}).get(workload)

    def ratio(got: dict, base: dict | None) -> float | None:
        if not base:
            return None
        if args.interleave and len(got["seconds"]) == len(base["seconds"]):
            return paired_ratio(got, base)
        return got["tokens_per_s"] / base["tokens_per_s"]

    rows = []
    width = max([12] + [len(w) for result in results.values() for w in result.get("workloads", {})])
    print(f"\n{args.arch} {args.dtype}, {args.prompts} prompts x {args.tokens} tokens (all in flight), "
          f"extract {args.extract_prompts} x ~{args.extract_len} tokens, median of {args.repeats}"
          f"{', runs interleaved' if args.interleave else ''}, {args.device}")
    print("ratios: " + ("the median of per-turn pairs (run k of one row against run k of the other)"
                        if args.interleave else "of medians of runs taken apart in time: brackets, not measurements "
                        "(--interleave pairs them)"))
    print(f"{'engine':<14} {'workload':<{width}} {'tok/s':>9} {'vs defaults':>11} {'vs eager':>9} {'vs local':>9} "
          f"{'vs gen':>7} {'MB/s':>8}  runs (s)")
    for engine, result in results.items():
        for workload, got in result.get("workloads", {}).items():
            # The plain rows' "extract" is the prefill of the same prompts; every workload's plain floor is
            # plain generate, except extraction, whose floor is that prefill.
            floor_workload = floor_of(workload.split("@")[0])
            ratios = {}
            for key, other, other_workload in (("vs_defaults", "vllm-defaults", floor_workload),
                                               ("vs_eager", "vllm-eager", floor_workload),
                                               ("vs_local", "local", workload)):
                # Interleaved, the floor's runs taken beside this workload's ("generate@trace"), if any.
                base = (found(other, f"{other_workload}@{workload}") or found(other, other_workload)
                        or (found(other, "prefill") if other_workload == "extract" else None))
                if key == "vs_local":  # RayVLLM against LocalVLLM in the same mode
                    base = found(engine.replace("ray", "local", 1), workload) if engine.startswith("ray") else None
                ratios[key] = ratio(got, base)
            # A trace (or a registered block) against the same engine's plain generate.
            ratios["vs_generate"] = ratio(got, found(engine, "generate")) if workload != "generate" else None
            row = {"engine": engine, "workload": workload, **got, **ratios}
            rows.append(row)
            fmt = lambda v, w=9: f"{v:>{w - 1}.2f}x" if v is not None else f"{'':>{w}}"  # noqa: E731
            print(f"{engine:<14} {workload:<{width}} {got['tokens_per_s']:>9,.0f} {fmt(ratios['vs_defaults']):>11} "
                  f"{fmt(ratios['vs_eager'])} {fmt(ratios['vs_local'])} {fmt(ratios['vs_generate'], 7)} "
                  f"{got['saved_mb_per_s']:>8.1f}  "
                  f"{', '.join(f'{t:.2f}' for t in got['seconds'])}"
                  f"{'  steps ' + json.dumps(got['step_modes']) if got.get('step_modes') else ''}")
        for workload, error in result.get("errors", {}).items():
            print(f"{engine:<14} {workload:<{width}} FAILED: {error}")
    for order, (engine, result) in enumerate(results.items(), start=1):
        if "start_s" in result:
            print(f"start {engine}: {result['start_s']:.1f} s (engine {order} of {len(results)})")
    print("SUMMARY " + " ".join(f"{r['engine']}/{r['workload']}={r['vs_defaults']:.3f}" for r in rows
                                if r["vs_defaults"] is not None))
    return rows


#: This checkout: a child imports the benchmark from here, whatever tree its ``nnsight_ray`` comes from.
ROOT = Path(__file__).resolve().parents[2]

#: A child's entry: this checkout's ``benchmarks.gpu`` (imported with ``ROOT`` first on the path, which is
#: then taken off again), and ``nnsight_ray`` from the child's own path: its ``--tree`` when it has one
#: (its working directory and first on ``PYTHONPATH``), else this environment's.
_CHILD = ("import sys; sys.path.insert(0, {root!r}); import benchmarks.gpu.cli as cli; sys.path.remove({root!r}); "
          "sys.exit(cli.main(sys.argv[1:]))")


def child_command() -> list[str]:
    """The command line that runs one engine's child (its arguments follow)."""
    return [sys.executable, "-c", _CHILD.format(root=str(ROOT))]


PREWARM = ("import torch, vllm, nnsight, ray, nnsight_ray\n"
           "if torch.cuda.is_available(): torch.cuda.init()")


def prewarm() -> None:
    """Import the stack once in a throwaway child, untimed: a fresh host's first engine start reads every
    library from disk (on an H200, plain vLLM eager started in 95 s as an invocation's first engine and in
    48 s as its fourth). What stays cold for the first engine: Ray's session and vLLM's on-disk caches."""
    began = time.perf_counter()
    code = subprocess.run([sys.executable, "-c", PREWARM], timeout=600).returncode
    print(f"[prewarm] imported the stack in {time.perf_counter() - began:.1f} s (exit {code}, untimed)", flush=True)


def main(argv: list[str] | None = None) -> None:
    from . import __doc__ as doc

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=doc.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU build's preset: tiny Llama, float32, small sizes")
    parser.add_argument("--arch", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--engines", default=None)
    parser.add_argument("--tree", action="append", default=[], metavar="TAG=DIR",
                        help="another checkout of nnsight_ray (a worktree of an older commit): an engine named "
                             "ENGINE@TAG runs with DIR first on PYTHONPATH, beside the others in the same run")
    parser.add_argument("--env", action="append", default=[], metavar="TAG=NAME=VALUE",
                        help="an environment variable for the engines named ENGINE%%TAG (repeatable)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--traces", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extract-prompts", type=int, default=None)
    parser.add_argument("--extract-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="each engine's share (default 0.5; with --interleave 0.85 split among the engines)")
    parser.add_argument("--interleave", action="store_true",
                        help="every engine's process alive at once (started one after another), their runs in "
                             "turn: run k of every row before run k+1 of any (the rows share the GPU's drift)")
    parser.add_argument("--shard-prompts", type=int, default=64, help="shards: prompts per part file")
    parser.add_argument("--cpus-per-rank", type=float, default=0,
                        help="RayVLLM rows: CPUs each rank reserves, and its OMP threads on the CPU build "
                             "(default: RayVLLM's, 1; plain vLLM's CPU worker uses every core)")
    parser.add_argument("--keep-prefix-cache", action="store_true",
                        help="plain vLLM rows keep their prefix cache between runs (by default each run starts "
                             "with it empty: every run repeats the same prompts)")
    parser.add_argument("--skip", default="", help="ENGINE:WORKLOAD,... pairs not to run (e.g. ray:extract, "
                        "ray%%cache:prefill): each names one engine row")
    parser.add_argument("--shards-dir", default="", help="shards: where the files go (default: the temp dir)")
    parser.add_argument("--model-dir", default=None, help="reuse a checkpoint built earlier")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine's child process")
    parser.add_argument("--prewarm", action=argparse.BooleanOptionalAction, default=True,
                        help="before the first engine, an untimed child imports the stack (and initializes "
                             "CUDA), so the first engine's start is not charged for a cold page cache")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the workloads, print the top N functions of each of --workloads (generate, registered, trace, every-step) under cProfile "
                             "(engine local-profile: LocalVLLM with vLLM's engine core in process)")
    parser.add_argument("--spy", type=float, default=0, metavar="S",
                        help="after the workloads, loop each of --spy-workloads for S seconds under py-spy, "
                             "sampling every process of the engine, and print each process's top frames")
    parser.add_argument("--spy-workloads", default="generate")
    parser.add_argument("--spy-only", default="", help="spy only the processes whose names contain one of these "
                        "(comma-separated: MergeActor,EngineActor,NNsightRankProc,EngineCore,bench); all by default")
    parser.add_argument("--spy-dir", default="", help="where the raw py-spy profiles go")
    parser.add_argument("--spy-bin", default="", help="py-spy, where it is not on PATH")
    parser.add_argument("--kernel-profile", default="", metavar="DIR",
                        help="after the workloads, one run of each --kernel-profile-workloads under vLLM's worker "
                             "profiler (torch.profiler); tables and traces go to DIR/<engine>/")
    parser.add_argument("--kernel-profile-workloads", default="prefill")
    parser.add_argument("--spy-top", type=int, default=25)
    parser.add_argument("--settle", type=float, default=SETTLE_S, metavar="S",
                        help="with --interleave: seconds between one turn's end and the next one's go (vLLM's "
                             "shared-memory readers spin on a core for 1 s after their last read: without a "
                             "pause, each turn shares the cores with the row that ran before it)")
    parser.add_argument("--schedstat", type=int, default=0, metavar="N",
                        help="with --interleave: per row and workload, the N threads of the host that ran most "
                             "during its turns (warm-ups included), with the time each ran and waited for a core "
                             "(schedstat.py)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--turns", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--turn-tag", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cpu = args.cpu
    defaults = dict(arch="llama" if cpu else "llama-1b", dtype="float32" if cpu else "bfloat16",
                    prompts=64 if cpu else 256, tokens=8 if cpu else 32, extract_prompts=32 if cpu else 256,
                    extract_len=64 if cpu else 128)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.child:
        from .child import child

        return child(args)

    import torch

    from nnsight_ray.models import ensure_model

    on_gpu = torch.cuda.is_available()
    args.device = f"GPU {torch.cuda.get_device_name()}" if on_gpu else "CPU"
    engines = (args.engines.split(",") if args.engines else
               [e for e in ENGINES if on_gpu or not e.startswith("nnsight-")])
    path = str(Path(ensure_model(args.model_dir or Path(tempfile.gettempdir()) / f"bench-{args.arch}",
                                 arch=args.arch)).resolve())
    for key in ("shards_dir", "spy_dir", "spy_bin", "kernel_profile"):  # a tree's child runs in that tree
        if getattr(args, key):
            setattr(args, key, str(Path(getattr(args, key)).resolve()))
    if args.gpu_memory_utilization is None:  # interleaved engines hold the GPU together
        args.gpu_memory_utilization = round(0.85 / len(engines), 3) if args.interleave else 0.5
    results: dict[str, dict] = {}
    forwarded = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in
                 ("workloads", "prompts", "tokens", "traces", "repeats", "extract_prompts", "extract_len",
                  "shard_prompts", "shards_dir", "skip", "cpus_per_rank",
                  "gpu_memory_utilization", "profile", "spy", "spy_workloads", "spy_dir", "spy_bin",
                  "spy_top", "spy_only", "kernel_profile", "kernel_profile_workloads")] + (["--keep-prefix-cache"] if args.keep_prefix_cache else [])
    if args.prewarm:
        prewarm()
    with tempfile.TemporaryDirectory() as scratch:
        children = []
        for index, engine in enumerate(engines):
            out = Path(scratch) / f"{engine}.json"
            command = [*child_command(), *forwarded, "--child", engine, "--child-json", str(out),
                       "--model-path", path, "--arch", args.arch, "--dtype", args.dtype]
            plain, extra = engine_env(engine, args.env)
            env = {**os.environ, **extra}
            base, tree = engine_tree(plain, args.tree)
            command[command.index("--child") + 1] = base
            command[command.index(f"--skip={args.skip}")] = f"--skip={child_skip(args.skip, engine, base)}"
            if args.interleave:
                command += ["--turns", scratch, "--turn-tag", f"e{index}"]
            if tree:
                env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [env.get("PYTHONPATH")] if p])
            # Ray puts its driver's working directory first on every worker's sys.path, so a tree's
            # child runs in that tree: otherwise its actors would import this checkout's nnsight_ray.
            if extra:
                print(f"[{engine}] the {base} engine with {extra}", flush=True)
            if base == "local-profile":  # the engine core in the child, so the profile sees the runner
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            children.append((engine, f"e{index}", command, env, tree, out))

        def collect(engine: str, out: Path, code: Any, seconds: float) -> None:
            results[engine] = json.loads(out.read_text()) if out.exists() else {"engine": engine, "errors": {}}
            results[engine]["engine"] = engine
            if code != 0:
                results[engine].setdefault("errors", {})["process"] = f"exit {code} after {seconds:.0f} s"
            if args.json:  # partial results survive a later engine's failure
                Path(args.json).write_text(json.dumps({"results": results, "args": vars(args)}, indent=1))

        if args.interleave:
            began = time.perf_counter()
            watch = Schedstat() if args.schedstat else None
            codes = interleave([(tag, command, env, tree) for _, tag, command, env, tree, _ in children],
                               Path(scratch), args.timeout * len(children), watch, args.settle)
            if watch:
                print(watch.report({tag: engine for engine, tag, *_ in children}, args.schedstat), flush=True)
            for engine, tag, *_, out in children:
                collect(engine, out, codes[tag], time.perf_counter() - began)
        else:
            for engine, tag, command, env, tree, out in children:
                began = time.perf_counter()
                try:
                    code = subprocess.run(command, timeout=args.timeout, env=env, cwd=tree).returncode
                except subprocess.TimeoutExpired:
                    code = "timeout"
                collect(engine, out, code, time.perf_counter() - began)
    rows = table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "results": results, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
