"""Prompts/s of the batch runner vs plain LocalVLLM loops, same model, saves and prompts.

Three ways to get the same values (every decoder layer's last-token residual
stream and the logits, per prompt) for the same prompts:

- ``local-loop``: one blocking ``LocalVLLM`` trace per prompt (nnsight's
  in-process engine, the way most notebooks do it);
- ``local-chunk``: one blocking ``LocalVLLM`` trace per ``--chunk`` prompts,
  one invoke each (nnsight's batched form);
- ``batch``: ``nnsight_ray.batch``'s hand-written runner (``run_batch``) on a
  ``RayVLLM`` engine of the same layout (``--tp``/``--pp``) on an embedded Ray
  cluster, with the runner's defaults (non-blocking traces of
  ``runner.prompts_per_trace`` invokes, ``max_in_flight`` prompts in flight),
  writing its Parquet shards and manifest as in any run;
- ``data``: the command line's path, the same config as a Ray Data pipeline
  (``pipeline.run_on_ray_data``) on the same engines by name (``--connect``):
  its rows under ``data/`` with Ray Data's checkpoint, as in any run. Its time
  includes the pipeline's own start (a client actor attaching; no engine starts).

The trace bodies are the runner's own (``interventions.read_saves`` over the
resolved save list), so the three do the same work per prompt. Engine start-up
is excluded from every number; each method runs ``--rounds`` times,
interleaved (loop, chunk, batch, loop, ...) so load from other processes hits
all alike, and the best round of each is reported with the median. The target
is ``batch >= 0.9 x max(local-loop, local-chunk)``.

Usage::

    python -m benchmarks.batch [--prompts N] [--rounds R] [--chunk C] [--tp T] [--pp P]
                                  [--nodes K] [--replicas N] [--prompts-per-trace K] [--max-in-flight W]
                                  [--model-dir DIR] [--json PATH]

Example::

    .venv/bin/python -m benchmarks.batch --prompts 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

KV_BYTES = 64 << 20


def prompts(n: int) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "ray", "vllm", "layer", "token", "shard", "lens"]
    return [f"{i}: " + " ".join(words[(i * 7 + j) % len(words)] for j in range(2 + i % 9)) for i in range(n)]


def local_loop(model, texts, fn) -> float:
    import nnsight

    start = time.perf_counter()
    for text in texts:
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            rows = nnsight.save([None])
            with tracer.invoke(text):
                rows[0] = fn(model, tracer)
        assert isinstance(rows[0], dict)
    return len(texts) / (time.perf_counter() - start)


def local_chunk(model, texts, fn, chunk: int) -> float:
    import nnsight

    start = time.perf_counter()
    for at in range(0, len(texts), chunk):
        part = texts[at : at + chunk]
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            rows = nnsight.save([None] * len(part))
            for i, text in enumerate(part):
                with tracer.invoke(text):
                    rows[i] = fn(model, tracer)
        assert all(isinstance(r, dict) for r in rows)
    return len(texts) / (time.perf_counter() - start)


def batch(engines, config_dict, out: Path, n: int) -> float:
    import io

    from nnsight_ray.batch.config import validate
    from nnsight_ray.batch.runner import run_batch

    shutil.rmtree(out, ignore_errors=True)
    config_dict = {**config_dict, "output": {"dir": str(out), "shard_size": 64}}
    result = run_batch(validate(config_dict), engines=engines, stream=io.StringIO(), interactive=False)
    assert result.complete and result.prompts_run == n, result.summary()
    return result.prompts_per_s


def data(engines, config_dict, out: Path, n: int) -> float:
    import io

    from nnsight_ray.batch.config import validate
    from nnsight_ray.batch.pipeline import run_on_ray_data
    from nnsight_ray.batch.preflight import prepare

    shutil.rmtree(out, ignore_errors=True)
    config_dict = {**config_dict, "output": {"dir": str(out), "shard_size": 64}}
    prepared = prepare(validate(config_dict))  # the model's meta tree: before the clock, as run_batch's
    result = run_on_ray_data(prepared, stream=io.StringIO(), interactive=False,
                             connect=[engine.name for engine in engines])
    assert result.complete and result.prompts_run == n, result.summary()
    return result.prompts_run / result.run_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=32, help="prompts per local-chunk trace")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=3, help="raylets of the embedded cluster")
    parser.add_argument("--replicas", type=int, default=1, help="batch engine replicas")
    parser.add_argument("--prompts-per-trace", type=int, help="runner.prompts_per_trace (default: the runner's)")
    parser.add_argument("--max-in-flight", type=int, help="runner.max_in_flight (default: the runner's)")
    parser.add_argument("--model-dir", help="tiny llama checkpoint (built if missing); default a temp dir")
    parser.add_argument("--json", help="write the numbers here as JSON")
    args = parser.parse_args()

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from nnsight_ray.batch.config import validate
    from nnsight_ray.batch.preflight import prepare
    from nnsight_ray.models import ensure_model

    work = Path(tempfile.mkdtemp(prefix="bench_batch_"))
    model_dir = str(ensure_model(args.model_dir or work / "model", arch="llama"))
    texts = prompts(args.prompts)
    (work / "prompts.txt").write_text("\n".join(texts) + "\n")
    engine_kwargs = {"max_model_len": 256, "dtype": "float32", "kv_cache_memory_bytes": KV_BYTES}
    config = {
        "model": {"path": model_dir},
        "engine": {"tensor_parallel_size": args.tp, "pipeline_parallel_size": args.pp,
                   "placement_strategy": "SPREAD", "engine_kwargs": engine_kwargs},
        "prompts": {"path": str(work / "prompts.txt")},
        "saves": [{"location": f"model.layers.{i}.output"} for i in range(4)] + [{"location": "logits"}],
        "output": {"dir": str(work / "out")},
    }
    runner = {k: v for k, v in (("prompts_per_trace", args.prompts_per_trace),
                                ("max_in_flight", args.max_in_flight)) if v}
    if runner:
        config["runner"] = runner
    prepared = prepare(validate(config))
    fn = prepared.fn

    from nnsight_ray.batch.local_cluster import LocalCluster

    cluster = LocalCluster(args.nodes, cpus_per_node=2, log_to_driver=False)
    from nnsight_ray import LocalVLLM, RayVLLM

    local_kwargs = dict(engine_kwargs)
    if args.tp * args.pp > 1:
        local_kwargs.update(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                            distributed_executor_backend="ray", placement_strategy="SPREAD")
    t = time.monotonic()
    local = LocalVLLM(model_dir, dispatch=True, **local_kwargs)
    local_start = time.monotonic() - t
    t = time.monotonic()
    engines = [RayVLLM(model_dir, name=f"bench-{i}", tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                       placement_strategy="SPREAD", **engine_kwargs) for i in range(args.replicas)]
    ray_start = time.monotonic() - t
    results: dict[str, list[float]] = {"local-loop": [], "local-chunk": [], "batch": [], "data": []}
    try:
        # Warm-up: first traces pay lazy imports and allocations.
        local_loop(local, texts[:8], fn)
        batch(engines, config, work / "warm", len(texts))
        data(engines, config, work / "warm-data", len(texts))
        for r in range(args.rounds):
            results["local-loop"].append(local_loop(local, texts, fn))
            results["local-chunk"].append(local_chunk(local, texts, fn, args.chunk))
            results["batch"].append(batch(engines, config, work / f"out{r}", len(texts)))
            results["data"].append(data(engines, config, work / f"data{r}", len(texts)))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items()) + " prompts/s",
                  flush=True)
    finally:
        for engine in engines:
            engine.shutdown()
        cluster.shutdown()

    best = {k: max(v) for k, v in results.items()}
    median = {k: statistics.median(v) for k, v in results.items()}
    baseline = max(best["local-loop"], best["local-chunk"])
    ratio = best["batch"] / baseline
    tuning = prepared.config.runner
    layout = (f"TP={args.tp} PP={args.pp}, {args.replicas} replica(s), {args.nodes} raylets, "
              f"runner {tuning.prompts_per_trace} prompts/trace x {tuning.max_in_flight} in flight")
    print()
    print(f"{args.prompts} prompts, 4 layer residuals + logits per prompt, {layout}, {args.rounds} rounds")
    print(f"engine start: LocalVLLM {local_start:.1f} s, RayVLLM {ray_start:.1f} s (excluded)")
    print(f"{'method':<12} {'best':>8} {'median':>8}  prompts/s")
    for key in results:
        print(f"{key:<12} {best[key]:>8.1f} {median[key]:>8.1f}")
    print(f"batch / best local = {ratio:.2f}x (target >= 0.9x): {'PASS' if ratio >= 0.9 else 'FAIL'}")
    paired = statistics.median(d / b for d, b in zip(results["data"], results["batch"]))
    print(f"data / batch (Ray Data against the runner, same engines, median of per-round ratios) = {paired:.2f}x "
          "(issue 51's target >= 0.95x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": args.prompts, "layout": layout, "rounds": results,
                                               "best": best, "median": median, "ratio": ratio,
                                               "data_over_batch": paired}, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ratio >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
