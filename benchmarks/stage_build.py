"""The Ray Data stage's trace of a batch: invokes that save their own values against invokes writing a slot.

The engine stage builds one trace per batch on its tracing thread, and that
thread bounds an actor's rate (``build`` in the stage's metrics). Two forms of
the same trace on one CPU ``RayVLLM`` (the project's tiny Llama), alternated in
one process: ``slots`` (a list saved above the invokes, each invoke writing
``rows[i]``: every invoke's state differs by ``i`` and is pickled on its own)
and ``values`` (each invoke saves its own ``values``, nnsight's collection
lists them in request order: every invoke's state is the same objects and is
pickled once). Prints each form's median build (the trace's ``with`` until the
requests are sent) and collection (sent -> values and outputs home) per batch,
their ratios, and checks both forms' values are equal.

    python -m benchmarks.stage_build [--batch 32] [--repeats 9] [--nodes 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stage_build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="invokes a trace (the stage's batch_size)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--model-dir", help="checkpoint (built if missing); default a temp dir")
    args = parser.parse_args()

    import torch

    from nnsight_ray import RayVLLM
    from nnsight_ray.batch.config import SaveSpec
    from nnsight_ray.batch.interventions import reader, resolve_saves
    from nnsight_ray._internal.cluster.local_cluster import LocalCluster
    from nnsight_ray.data.stage import run_trace, trace_rows
    from nnsight_ray.models import ensure_model

    work = tempfile.mkdtemp(prefix="stage-build-")
    model_dir = str(ensure_model(args.model_dir or f"{work}/model"))
    cluster = LocalCluster(args.nodes, cpus_per_node=2, log_to_driver=False)
    model = None
    try:
        model = RayVLLM(model_dir, name="stage-build")
        fn = reader(resolve_saves(model._module, [SaveSpec(location="model.layers.1.output", tokens="last")]))
        requests = [(f"prompt {i} of the batch, about the weather in town {i % 7}", {"max_tokens": 1,
                                                                                      "temperature": 0.0})
                    for i in range(args.batch)]
        forms = {"slots": True, "values": False}
        built = {form: [] for form in forms}
        collected = {form: [] for form in forms}
        rows = {}
        for turn in range(args.repeats + 1):  # the first turn warms both
            for form, slots in forms.items():
                start = time.perf_counter()
                tracer = run_trace(model, fn, requests, False, slots)
                sent = time.perf_counter()
                rows[form] = trace_rows(tracer)
                if turn:
                    built[form].append(sent - start)
                    collected[form].append(time.perf_counter() - sent)
        for (a, *rest_a), (b, *rest_b) in zip(rows["slots"], rows["values"]):
            assert rest_a == rest_b and a.keys() == b.keys()
            assert all(torch.equal(a[name], b[name]) for name in a), "the two forms' values differ"
        print(f"{args.batch} invokes a trace, one saved value each; medians of {args.repeats}, alternated (ms)")
        print(f"{'form':<8} {'build':>8} {'collect':>9}")
        for form in forms:
            print(f"{form:<8} {statistics.median(built[form]) * 1e3:>8.2f} "
                  f"{statistics.median(collected[form]) * 1e3:>9.2f}")
        print(f"build slots / values = {statistics.median(built['slots']) / statistics.median(built['values']):.2f}x; "
              f"collect slots / values = "
              f"{statistics.median(collected['slots']) / statistics.median(collected['values']):.2f}x; values equal")
    finally:
        if model is not None:
            model.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
