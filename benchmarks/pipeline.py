"""Measure what tracing across pipeline stages costs, side by side with one stage.

Starts a local Ray cluster (three raylets on 127.0.0.1) unless ``--address``
names one, builds the project's tiny seeded Llama (4 layers, so PP=2 puts
layers 0-1 on stage 0 and 2-3 on stage 1), and brings up two engines whose
ranks are Ray actors: ``pipeline_parallel_size=2`` and ``=1``. After a warm-up
it times ``--runs`` repetitions of each case, interleaved across the engines so
load from other processes hits them alike, and prints medians:

1. ``plain``: ``model.generate(prompt, max_tokens=1)``, no intervention — what
   the layouts cost by themselves.
2. ``save``: a one-token trace saving one layer per stage::

       with model.trace(prompt, temperature=0.0, max_tokens=1):
           a = model.model.layers[1].output[0].save()   # stage 0
           b = model.model.layers[3].output[0].save()   # stage 1

   reported as PP=2 / PP=1 and as trace-over-plain on each layout.
3. ``decode`` vs ``dependency``: an 8-step generation saving layer 3 every step,
   without and with one cross-stage dependency per step::

       for step in tracer.all():
           h = model.model.layers[1].output[0].clone()   # stage 0
           model.model.layers[3].output[0][:] += h        # stage 1

   reported as the added milliseconds per step on each layout.

Timings on a shared machine are noisy; compare medians, not single runs.

Usage::

    python -m benchmarks.pipeline [--runs N] [--warmup N] [--steps N]
                                     [--prompt TEXT] [--model-dir DIR] [--address ADDR]

Example::

    .venv/bin/python -m benchmarks.pipeline --runs 15
"""

from __future__ import annotations

import os

# Before ray is imported: every raylet and driver on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import statistics
import tempfile
import time
from typing import Any, Callable


def plain(model: Any, prompt: str, steps: int) -> None:
    model.generate(prompt, max_tokens=1, temperature=0.0)


def save(model: Any, prompt: str, steps: int) -> None:
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        a = model.model.layers[1].output[0].save()
        b = model.model.layers[3].output[0].save()
    assert a.shape == b.shape


def decode(model: Any, prompt: str, steps: int) -> None:
    with model.trace(prompt, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        late = [].save()
        for step in tracer.all():
            late.append(model.model.layers[3].output[0].clone())
    assert len(late) == steps


def dependency(model: Any, prompt: str, steps: int) -> None:
    with model.trace(prompt, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        late = [].save()
        for step in tracer.all():
            h = model.model.layers[1].output[0].clone()
            model.model.layers[3].output[0][:] += h
            late.append(model.model.layers[3].output[0].clone())
    assert len(late) == steps


CASES: dict[str, Callable[[Any, str, int], None]] = {
    "plain": plain,
    "save": save,
    "decode": decode,
    "dependency": dependency,
}


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def start_cluster(address: str | None) -> Any:
    import ray

    if address:
        ray.init(address=address, namespace="nnsight_ray")
        return None
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="nnsight_ray")
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="decode steps of the generation cases")
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    parser.add_argument("--model-dir", default=None, help="checkpoint folder (default: build the tiny Llama in a temp dir)")
    parser.add_argument("--address", default=None, help="an existing Ray cluster (default: start one on 127.0.0.1)")
    args = parser.parse_args()

    import ray

    from nnsight_ray import LocalVLLM
    from nnsight_ray.models import ensure_model

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "nnsight-ray-bench-llama")
    ensure_model(model_dir, arch="llama")
    cluster = start_cluster(args.address)
    engines = {}
    try:
        for pp in (2, 1):
            start = time.perf_counter()
            engines[pp] = LocalVLLM(
                model_dir,
                dispatch=True,
                dtype="float32",
                max_model_len=256,
                pipeline_parallel_size=pp,
                distributed_executor_backend="ray",
                placement_strategy="SPREAD",
            )
            print(f"PP={pp}: engine up in {time.perf_counter() - start:.1f} s", flush=True)

        times: dict[tuple[str, int], list[float]] = {(case, pp): [] for case in CASES for pp in engines}
        for run in range(args.warmup + args.runs):
            for case, fn in CASES.items():
                for pp, model in engines.items():
                    elapsed = timed(lambda: fn(model, args.prompt, args.steps))
                    if run >= args.warmup:
                        times[(case, pp)].append(elapsed)

        med = {key: statistics.median(values) * 1e3 for key, values in times.items()}
        print(f"\nmedian latency (ms) over {args.runs} runs, prompt of {len(args.prompt)} tokens")
        print(f"{'case':<12}{'PP=1':>10}{'PP=2':>10}{'PP2/PP1':>10}")
        for case in CASES:
            one, two = med[(case, 1)], med[(case, 2)]
            print(f"{case:<12}{one:>10.1f}{two:>10.1f}{two / one:>10.2f}")
        print("\ntrace over plain generate (one token):")
        for pp in (1, 2):
            print(f"  PP={pp}: {med[('save', pp)] / med[('plain', pp)]:.2f}x")
        print(f"\none cross-stage dependency per step ({args.steps} steps), added latency:")
        for pp in (1, 2):
            added = med[("dependency", pp)] - med[("decode", pp)]
            print(f"  PP={pp}: {added:+.1f} ms per trace, {added / args.steps:+.2f} ms per step")
    finally:
        for model in engines.values():
            try:
                model.vllm_entrypoint.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    main()
