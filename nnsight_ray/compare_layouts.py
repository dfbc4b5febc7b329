"""``nnsight-ray compare-layouts``: one trace under several TP x PP x placement layouts, each checked against
the single-rank run.

For every layout the command starts a ``RayVLLM`` engine, runs the same
greedy trace (every decoder layer's output at every generation step, the
logits of every step, the generated tokens) on each prompt, compares all of
it with the single-rank engine (TP=1, PP=1) on the same cluster, records
where every rank ran (pp rank, tp rank, node, actor name) and how long the
engine took to start and to answer, then shuts the engine down before the
next layout. Layouts that cannot be placed or started are reported as such
and the others still run.

Usage::

    nnsight-ray compare-layouts [--model DIR | --arch llama|gpt2]
        [--layouts TPxPP,...] [--strategies STRATEGY,...]
        [--address HOST:PORT | --local-nodes N [--cpus-per-node C]]
        [--prompt TEXT ...] [--max-tokens N] [--repeats N] [--rel-tol X]
        [--engine-arg KEY=VALUE ...] [--reference NAME] [--json FILE]

(``python -m nnsight_ray.cli compare-layouts ...`` is the same command.)

Examples::

    # an embedded three-raylet cluster on 127.0.0.1 and the project's tiny Llama:
    # TP=2, PP=2 and TP=2 x PP=2 under SPREAD
    nnsight-ray compare-layouts
    # the local simulation of cluster_configs/local-multinode.sh, two strategies
    bash cluster_configs/local-multinode.sh
    RAY_ADDRESS=127.0.0.1:6390 nnsight-ray compare-layouts --layouts 2x1,1x2 \\
        --strategies STRICT_SPREAD,PACK
    # a GPU cluster (run on a cluster node or as a Ray job), a checkpoint on shared storage
    nnsight-ray compare-layouts --address auto --model /mnt/shared/llama-3-8b \\
        --layouts 4x1,2x2,1x4 --engine-arg dtype=bfloat16 --rel-tol 2e-2

A layout ``TPxPP`` is tensor x pipeline parallel size (``2x1`` = TP=2). Each
layout runs once per strategy (``PACK``, ``SPREAD``, ``STRICT_PACK``,
``STRICT_SPREAD``). Values match when the norm-wise relative error of every
compared tensor is below ``--rel-tol`` (1e-3 by default: float32 TP reductions
differ from one rank's in the last bits) and the generated tokens are equal.

Exit status: 0 when every layout started and matched, 1 when one did not
match or failed, 2 for bad arguments. ``--json`` writes the full report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["add_arguments", "build_parser", "check_arguments", "main", "run"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEFAULT_PROMPTS = ("The quick brown fox", "Hello world, this is", "abc")
# Engine arguments for the tiny checkpoints (a 64 MiB KV cache is plenty on CPU).
TINY_ENGINE_ARGS = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20}


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"2x1,1x2"`` -> ``[(2, 1), (1, 2)]`` (TP, PP)."""
    layouts = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            tp, pp = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"layout {item!r}: expected TPxPP, e.g. 2x1 or 2x2") from None
        if tp < 1 or pp < 1:
            raise argparse.ArgumentTypeError(f"layout {item!r}: sizes must be >= 1")
        layouts.append((tp, pp))
    if not layouts:
        raise argparse.ArgumentTypeError("no layout given")
    return layouts


def parse_strategies(text: str) -> list[str]:
    strategies = [s.strip().upper() for s in text.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise argparse.ArgumentTypeError(f"strategies {unknown or text!r}: choose from {', '.join(STRATEGIES)}")
    return strategies


def parse_engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"engine arg {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="checkpoint folder readable by every node (default: build the tiny one)")
    model.add_argument("--arch", default="llama", choices=("llama", "gpt2"),
                       help="tiny checkpoint to build when --model is not given (default llama)")
    parser.add_argument("--layouts", type=parse_layouts, default=parse_layouts("2x1,1x2,2x2"),
                        help="comma-separated TPxPP layouts (default 2x1,1x2,2x2)")
    parser.add_argument("--strategies", type=parse_strategies, default=["SPREAD"],
                        help="comma-separated placement strategies (default SPREAD)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                       help="join this cluster (GCS address or 'auto'; default $RAY_ADDRESS)")
    where.add_argument("--local-nodes", type=int, default=3,
                       help="without --address: raylets of the embedded cluster on 127.0.0.1 (default 3)")
    parser.add_argument("--cpus-per-node", type=int, default=4, help="CPUs of each embedded raylet (default 4)")
    parser.add_argument("--prompt", dest="prompts", action="append", help="prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=3, help="greedy tokens per prompt (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="timed traces per prompt after the first (default 3)")
    parser.add_argument("--rel-tol", type=float, default=1e-3, help="norm-wise relative tolerance (default 1e-3)")
    parser.add_argument("--engine-arg", dest="engine_args", action="append", type=parse_engine_arg, default=[],
                        metavar="KEY=VALUE", help="vLLM engine argument, JSON-decoded when possible (repeatable)")
    parser.add_argument("--reference", metavar="NAME",
                        help="use the running single-rank deployment NAME (RayVLLM.connect) as the reference "
                             "instead of starting one; it must serve the same checkpoint with TP=1, PP=1")
    parser.add_argument("--json", dest="json_path", help="write the report here")
    parser.add_argument("--workdir", default="runs/compare-layouts", help="where the tiny checkpoint goes")
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on others, and the ranges argparse does not check (``parser.error``: exit 2)."""
    args.prompts = args.prompts or list(DEFAULT_PROMPTS)
    if args.max_tokens < 1 or args.repeats < 0 or args.local_nodes < 1:
        parser.error("--max-tokens and --local-nodes must be >= 1, --repeats >= 0")
    return args


# --------------------------------------------------------------------------- the trace


def decoder_layers(model) -> tuple[str, int]:
    """The meta tree's decoder-layer list (path, length): the longest ``ModuleList``."""
    import torch

    best = max(((name, len(module)) for name, module in model._module.named_modules()
                if isinstance(module, torch.nn.ModuleList)), key=lambda item: item[1], default=None)
    if best is None:
        raise SystemExit("the model has no ModuleList of layers to compare")
    return best


def envoy_at(model, path: str):
    envoy = model
    for part in path.split("."):
        envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
    return envoy


def run_trace(model, layers_path: str, n_layers: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Every layer's output at every step, every step's logits, the greedy tokens.

    A decoder layer's output is a tensor or a tuple (Llama: hidden states and
    residual); every tensor in it is kept.
    """
    import nnsight

    layers = envoy_at(model, layers_path)
    with model.trace(prompt, temperature=0.0, max_tokens=max_tokens) as tracer:
        hidden = nnsight.save([])
        logits = nnsight.save([])
        samples = nnsight.save([])
        # An open `tracer.all()` loop ends when generation does: nothing after
        # it in the block runs, so the tokens come from `model.samples`.
        for _ in tracer.all():
            step = []
            for i in range(n_layers):
                out = layers[i].output
                parts = out if isinstance(out, tuple) else (out,)
                step.append([p.clone() for p in parts if p is not None])
            hidden.append(step)
            logits.append(model.logits.clone())
            samples.append(model.samples.clone())
    return {"hidden": hidden, "logits": logits, "tokens": [s.tolist() for s in samples]}


def relative_error(got, want) -> float:
    import torch

    got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """Worst relative error over every compared tensor, and whether tokens agree."""
    worst, where = 0.0, None
    if len(got["hidden"]) != len(want["hidden"]) or len(got["logits"]) != len(want["logits"]):
        return {"tokens_equal": False, "max_rel_err": float("inf"), "worst": "number of steps"}
    for step, (g_step, w_step) in enumerate(zip(got["hidden"], want["hidden"])):
        for layer, (g_parts, w_parts) in enumerate(zip(g_step, w_step)):
            if len(g_parts) != len(w_parts):
                return {"tokens_equal": False, "max_rel_err": float("inf"), "worst": f"layer {layer} outputs"}
            for part, (g, w) in enumerate(zip(g_parts, w_parts)):
                err = relative_error(g, w)
                if err > worst or where is None:
                    worst, where = max(err, worst), f"step {step} layer {layer} output[{part}]"
    for step, (g, w) in enumerate(zip(got["logits"], want["logits"])):
        err = relative_error(g, w)
        if err > worst:
            worst, where = err, f"step {step} logits"
    return {"tokens_equal": got["tokens"] == want["tokens"], "max_rel_err": worst, "worst": where}


# --------------------------------------------------------------------------- layouts


def node_labels() -> dict[str, str]:
    """Ray node id -> readable label (its custom ``node_*`` resource, else node<i>@ip)."""
    import ray

    labels = {}
    for index, node in enumerate(sorted(ray.nodes(), key=lambda n: (not n.get("Resources", {}).get(
            "node:__internal_head__"), n["NodeID"]))):
        named = sorted(r for r in node.get("Resources", {}) if r.startswith("node_"))
        ip = node.get("NodeManagerAddress", "?")
        labels[node["NodeID"]] = f"{named[0]}@{ip}" if named else f"node{index}@{ip}"
    return labels


def run_layout(model_path: str, tp: int, pp: int, strategy: str, prompts: list[str], args: argparse.Namespace,
               engine_args: dict[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Start the engine, trace every prompt (first run + ``repeats`` timed), shut it down."""
    from .ray_vllm import RayVLLM

    report: dict[str, Any] = {"layout": f"{tp}x{pp}", "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                              "placement_strategy": strategy, "name": name}
    started = time.perf_counter()
    try:
        model = RayVLLM(model_path, name=name, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                        placement_strategy=strategy, **engine_args)
    except Exception as error:  # placement refused, engine failed: report it, go on with the others
        report.update(status="failed to start", error=f"{type(error).__name__}: {error}"[:2000])
        return report, None
    report["start_s"] = round(time.perf_counter() - started, 2)
    try:
        return measure(model, prompts, args, report)
    finally:
        model.shutdown()


def connect_reference(name: str, model_path: str, prompts: list[str], args: argparse.Namespace
                      ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The reference from a running deployment (``--reference NAME``): traced, not started or stopped."""
    from .ray_vllm import RayVLLM

    report: dict[str, Any] = {"layout": "1x1", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                              "name": name, "connected": True}
    try:
        model = RayVLLM.connect(name)
    except Exception as error:
        report.update(status="failed to connect", error=f"{type(error).__name__}: {error}"[:2000])
        return report, None
    served = model.vllm_entrypoint.deployment.spec.model
    if len(model.topology()) != 1 or os.path.realpath(served) != os.path.realpath(model_path):
        report.update(status="not a reference", error=f"deployment {name!r} runs {served} on "
                      f"{len(model.topology())} rank(s); the reference is {model_path} on one rank")
        return report, None
    return measure(model, prompts, args, report)


def measure(model, prompts: list[str], args: argparse.Namespace, report: dict[str, Any]
            ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Trace every prompt (first run + ``repeats`` timed); where the ranks ran."""
    try:
        labels = node_labels()
        report["ranks"] = [{"pp_rank": t["pp_rank"], "tp_rank": t["tp_rank"], "node_id": t["node_id"],
                            "node": labels.get(t["node_id"], "?"), "actor_name": t["actor_name"]}
                           for t in sorted(model.topology(), key=lambda t: t["rank"])]
        layers_path, n_layers = decoder_layers(model)
        values, times = {}, []
        for prompt in prompts:
            values[prompt] = run_trace(model, layers_path, n_layers, prompt, args.max_tokens)
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                run_trace(model, layers_path, n_layers, prompt, args.max_tokens)
                times.append(time.perf_counter() - t0)
        if times:
            report["trace_s_median"] = round(statistics.median(times), 4)
        report["status"] = "ran"
        return report, values
    except Exception as error:
        report.update(status="trace failed", error=f"{type(error).__name__}: {error}"[:2000])
        return report, None


def connect(args: argparse.Namespace):
    """Join ``--address``, or start the embedded cluster. Returns its shutdown (or None)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from ._internal.cluster.placement import NAMESPACE

    if ray.is_initialized():
        return None
    if args.address:
        ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
        return ray.shutdown
    from ._internal.cluster.local_cluster import LocalCluster

    cluster = LocalCluster(args.local_nodes, cpus_per_node=args.cpus_per_node, log_to_driver=False)
    return cluster.shutdown


def compare_layouts(args: argparse.Namespace) -> dict[str, Any]:
    """Reference first (TP=1, PP=1, PACK), then every layout x strategy; the report."""
    import uuid

    from .models import ensure_model

    model_path = args.model or str(ensure_model(Path(args.workdir) / f"tiny-{args.arch}", arch=args.arch))
    # The defaults size the CPU engine for the tiny checkpoints only.
    engine_args = {**({} if args.model else TINY_ENGINE_ARGS), **dict(args.engine_args)}
    run_id = uuid.uuid4().hex[:6]
    if args.reference:
        reference, want = connect_reference(args.reference, model_path, args.prompts, args)
    else:
        reference, want = run_layout(model_path, 1, 1, "PACK", args.prompts, args, engine_args,
                                     f"compare-{run_id}-reference")
    report = {"model": model_path, "prompts": args.prompts, "max_tokens": args.max_tokens, "rel_tol": args.rel_tol,
              "engine_args": engine_args, "reference": reference, "layouts": []}
    if want is None:
        report["all_match"] = False
        return report
    for tp, pp in args.layouts:
        for strategy in args.strategies:
            entry, got = run_layout(model_path, tp, pp, strategy, args.prompts, args, engine_args,
                                    f"compare-{run_id}-tp{tp}pp{pp}-{strategy.lower()}")
            if got is not None:
                per_prompt = {prompt: compare(got[prompt], want[prompt]) for prompt in args.prompts}
                worst = max(per_prompt.values(), key=lambda c: c["max_rel_err"])
                entry["max_rel_err"] = worst["max_rel_err"]
                entry["worst"] = worst["worst"]
                entry["tokens_equal"] = all(c["tokens_equal"] for c in per_prompt.values())
                entry["match"] = entry["tokens_equal"] and entry["max_rel_err"] < args.rel_tol
                if reference.get("trace_s_median") and entry.get("trace_s_median"):
                    entry["trace_vs_reference"] = round(entry["trace_s_median"] / reference["trace_s_median"], 2)
            else:
                entry["match"] = False
            report["layouts"].append(entry)
    report["all_match"] = bool(report["layouts"]) and all(e["match"] for e in report["layouts"])
    return report


def print_report(report: dict[str, Any]) -> None:
    ref = report["reference"]
    print(f"model {report['model']}; {len(report['prompts'])} prompts x {report['max_tokens']} greedy tokens; "
          f"every layer's output and the logits at every step; match = tokens equal and rel err < "
          f"{report['rel_tol']:g}")
    print(f"reference TP=1 PP=1{' (running deployment ' + ref['name'] + ')' if ref.get('connected') else ''}: "
          f"{ref.get('status')}, start {ref.get('start_s', '-')} s, "
          f"trace {ref.get('trace_s_median', '-')} s  {ref.get('error', '')}")
    header = f"{'layout':8} {'strategy':14} {'match':6} {'max rel err':>11} {'start s':>8} {'trace s':>8} {'vs 1x1':>6}"
    print(header)
    print("-" * len(header))
    for e in report["layouts"]:
        err = f"{e['max_rel_err']:.1e}" if "max_rel_err" in e else "-"
        print(f"{e['layout']:8} {e['placement_strategy']:14} {('yes' if e['match'] else 'NO'):6} {err:>11} "
              f"{e.get('start_s', '-')!s:>8} {e.get('trace_s_median', '-')!s:>8} "
              f"{e.get('trace_vs_reference', '-')!s:>6}")
        if e.get("error"):
            print(f"    {e['status']}: {e['error'].splitlines()[0][:300]}")
        elif not e["match"]:
            print(f"    worst at {e.get('worst')}; tokens equal: {e.get('tokens_equal')}")
        for r in e.get("ranks", []):
            print(f"    pp{r['pp_rank']}.tp{r['tp_rank']} on {r['node']} ({r['node_id'][:8]})  {r['actor_name']}")
    print("all layouts match the single-rank run" if report["all_match"] else "NOT every layout matches")


def run(args: argparse.Namespace) -> int:
    """Every layout of ``args`` against the reference; the exit status (0: every layout matched)."""
    stop = connect(args)
    try:
        report = compare_layouts(args)
    finally:
        if stop is not None:
            stop()
    print_report(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["all_match"] else 1


def build_parser(prog: str = "nnsight-ray compare-layouts") -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))


def main(argv: Sequence[str] | None = None) -> int:
    command = build_parser()
    return run(check_arguments(command, command.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
