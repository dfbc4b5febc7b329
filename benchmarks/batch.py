"""Prompts/s of a batch run (Ray Data) vs plain LocalVLLM loops and Ray Data LLM's plain processor.

Ways to get the same values (every decoder layer's last-token residual
stream and the logits, per prompt) for the same prompts:

- ``local-loop``: one blocking ``LocalVLLM`` trace per prompt (nnsight's
  in-process engine, the way most notebooks do it);
- ``local-chunk``: one blocking ``LocalVLLM`` trace per ``--chunk`` prompts,
  one invoke each (nnsight's batched form);
- ``data``: ``run_batch(config, engines=[...])``, the batch config as a Ray Data
  pipeline (``pipeline.run_on_ray_data``) on running ``RayVLLM`` engines of the
  same layout (``--tp``/``--pp``) on an embedded Ray cluster, by name (the
  command line's ``--connect``), with the config's defaults (non-blocking traces
  of ``runner.prompts_per_trace`` invokes, ``max_in_flight`` prompts in flight):
  its rows under ``data/`` with Ray Data's checkpoint, as in any run. Its time
  includes the pipeline's own start (a client actor attaching; no engine starts).

- ``data-own``: the command line's path as a run without ``--connect`` does it: the
  Ray Data pipeline starts its own engine (``engine.replicas`` actors) and
  stops it at the end; compare its steady rate (its whole run includes the
  engine's start). ``data-own-1``: the same with one batch in flight per actor
  (``runner.max_in_flight`` = ``prompts_per_trace``), where the engine runs in
  the actor (a ``LocalVLLM``, nnsight's blocking trace, one at a time).

- ``plain``: Ray Data LLM's own vLLM processor (``ray.data.llm``'s
  ``vLLMEngineProcessorConfig``, no interventions: tokens only) on the same
  prompts, engine settings, batch size and batches in flight, reading and
  writing as ``data`` does. It starts its own engine in its actor, so its
  whole-run time includes an engine start; compare its steady rate.

For ``data`` and ``data-own`` the engine stage's metrics (``docs/metrics.md``,
read from Ray's export ports before and after each run) give where a batch's
time went: mean seconds per batch ``queued`` (waiting for the actor's tracing
thread), ``build`` (the trace built and sent), ``engine`` (sent -> values and
outputs back), ``rows`` and ``total``, and the batches in flight on average
over the steady part (total batch-seconds x steady rate / prompts).

Besides the whole run's prompts/s, ``data``, ``data-own`` and ``plain`` get a
**steady** rate from the times their output files were written (prompts after
the first file / time from the first file to the last): what a long run
converges to, without each path's own start (an actor's process start,
attaching or an engine start, and Ray Data's planning).

The local trace bodies are the batch run's own (``interventions.read_saves``
over the resolved save list), so every method does the same work per prompt.
Engine start-up is excluded from every number but the ``-own`` and ``plain``
whole-run rates; each method runs ``--rounds`` times, interleaved (loop,
chunk, data, loop, ...) so load from other processes hits all alike, and the
best round of each is reported with the median.

Usage::

    python -m benchmarks.batch [--prompts N] [--rounds R] [--chunk C] [--tp T] [--pp P]
                                  [--nodes K] [--replicas N] [--prompts-per-trace K] [--max-in-flight W]
                                  [--methods local-loop,local-chunk,data,data-own,plain] [--clients N] [--arch A]
                                  [--gpu-memory-utilization F] [--model-dir DIR] [--json PATH]

On a GPU (the GPU host), engines take ``--gpu-memory-utilization`` each (the
local engine, the RayVLLM and the plain processor's share the card), bf16,
and the embedded cluster is one raylet with the card.

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
BLOCK = 64  # rows per block and per file on every Ray Data path (the CLI's output.shard_size here)
PHASES = ("queued", "build", "engine", "rows", "total")


def stage_phases(before: list, batches: int, seconds: float = 30) -> dict[str, float]:
    """The engine stage's batches since ``before`` (a scrape of the export ports): mean seconds per phase and their
    count, once Ray has flushed at least ``batches`` of them (or after ``seconds``)."""
    from nnsight_ray._internal.observe.metrics import exported_samples, sample_sum

    name = "ray_nnsight_data_batch_seconds"
    deadline = time.monotonic() + seconds
    while True:
        now = exported_samples()
        count = {p: sample_sum(now, f"{name}_count", phase=p) - sample_sum(before, f"{name}_count", phase=p)
                 for p in PHASES}
        if count["total"] >= batches or time.monotonic() > deadline:
            break
        time.sleep(1)
    out = {p: (sample_sum(now, f"{name}_sum", phase=p) - sample_sum(before, f"{name}_sum", phase=p)) / count[p]
           for p in PHASES if count[p]}
    out["batches"] = count["total"]
    out["batch_seconds"] = out.get("total", 0.0) * count["total"]
    return out


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


class PeakRSS:
    """The driver's peak resident memory (MB) while the block runs, sampled every 50 ms, and its rise over the
    memory at the block's start (the process keeps what earlier methods took)."""

    def __enter__(self) -> "PeakRSS":
        import threading

        import psutil

        self.peak, self._stop, process = 0.0, threading.Event(), psutil.Process()
        self.start = process.memory_info().rss / 1e6

        def sample() -> None:
            while True:
                self.peak = max(self.peak, process.memory_info().rss / 1e6)
                if self._stop.wait(0.05):
                    return

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def steady(files: list[Path], n: int) -> float | None:
    """Prompts/s from the first written file to the last (by mtime), the first file's prompts excluded."""
    import pyarrow.parquet as pq

    stamped = sorted((path.stat().st_mtime, pq.read_metadata(path).num_rows) for path in files)
    if len(stamped) < 2 or stamped[-1][0] <= stamped[0][0]:
        return None
    return (sum(rows for _, rows in stamped) - stamped[0][1]) / (stamped[-1][0] - stamped[0][0])


def data(engines, config_dict, out: Path, n: int, clients: int = 1) -> tuple[float, float | None, dict]:
    import io

    from nnsight_ray.batch.config import validate
    from nnsight_ray.batch.pipeline import run_on_ray_data
    from nnsight_ray.batch.preflight import prepare

    from nnsight_ray._internal.observe.metrics import exported_samples

    shutil.rmtree(out, ignore_errors=True)
    config_dict = {**config_dict, "output": {"dir": str(out), "shard_size": BLOCK}}
    prepared = prepare(validate(config_dict))  # the model's meta tree: before the clock, as run_batch's
    before = exported_samples()
    result = run_on_ray_data(prepared, stream=io.StringIO(), interactive=False,
                             connect=[engine.name for engine in engines] if engines else None, clients=clients)
    assert result.complete and result.prompts_run == n, result.summary()
    rate = steady(list((out / "data").glob("*.parquet")), n)
    phases = stage_phases(before, -(-n // prepared.config.runner.prompts_per_trace))
    if rate:
        phases["in_flight"] = phases["batch_seconds"] * rate / n
    return result.prompts_run / result.run_s, rate, phases


def plain_tasks(in_flight: int, batch_size: int, block: int) -> int:
    """Ray Data LLM's ``max_concurrent_batches`` that puts ``in_flight`` batches of ``batch_size`` on its engine.

    It is the engine actor's task concurrency (Ray Core ``max_concurrency``), and Ray Data runs the batches of
    one task's block at once (up to ``RAY_DATA_DEFAULT_ASYNC_BATCH_UDF_MAX_CONCURRENCY``, 4): with blocks of 64
    and batches of 32, 8 tasks hold 16 batches. nnsight_ray's stage holds at most ``max_concurrent_batches`` on
    its engine whatever the blocks, so the plain processor takes fewer tasks for the same batches in flight."""
    from ray.data._internal.planner.plan_udf_map_op import DEFAULT_ASYNC_BATCH_UDF_MAX_CONCURRENCY

    per_task = max(1, min(DEFAULT_ASYNC_BATCH_UDF_MAX_CONCURRENCY, -(-block // batch_size)))
    return max(1, -(-in_flight // per_task))


def plain(model_dir: str, engine_kwargs: dict, texts_path: Path, out: Path, n: int, batch_size: int,
          in_flight: int, bundle: dict) -> tuple[float, float | None]:
    """Ray Data LLM's vLLM processor over the same prompts, read and written as ``data``'s (blocks of 64), with
    ``in_flight`` batches on its engine, as ``data``'s: its ``max_concurrent_batches`` is the actor's task
    concurrency, and each task runs the batches of its block at once (``plain_tasks``)."""
    import ray.data
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    shutil.rmtree(out, ignore_errors=True)
    config = vLLMEngineProcessorConfig(model_source=model_dir, engine_kwargs=dict(engine_kwargs),
                                       batch_size=batch_size, concurrency=1,
                                       max_concurrent_batches=plain_tasks(in_flight, batch_size, BLOCK),
                                       placement_group_config={"bundles": [bundle]},
                                       chat_template_stage=False, detokenize_stage=False)
    processor = build_processor(
        config, preprocess=lambda row: {"prompt": row["text"], "sampling_params": {"max_tokens": 1, "temperature": 0.0}},
        postprocess=lambda row: {"text": row["text"], "generated_text": row["generated_text"]})
    start = time.perf_counter()
    prompts = ray.data.read_text(str(texts_path)).repartition(target_num_rows_per_block=BLOCK, strict=True)
    processor(prompts).write_parquet(str(out), min_rows_per_file=BLOCK)
    seconds = time.perf_counter() - start
    files = list(out.glob("*.parquet"))
    import pyarrow.parquet as pq

    assert sum(pq.read_metadata(path).num_rows for path in files) == n
    return n / seconds, steady(files, n)


def prepared_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def spy_data(engines, config_dict, out: Path, n: int, clients: int, seconds: float, top: int,
             spy_dir: str = "", binary: str = "") -> None:
    """One more ``data`` run (``engines=None``: ``data-own``) with py-spy on every Ray process (the client
    actors, Ray Data's workers, the engine, merge and rank actors) and this driver, for ``seconds`` from
    its first written file (its steady part); each process's top frames are printed."""
    import re
    import subprocess
    import threading

    from benchmarks.gpu.diagnostics import engine_processes, spy_summary

    binary = shutil.which("py-spy") or binary
    if not binary or not Path(binary).exists():
        print("[spy] no py-spy binary (pass --spy-bin)", flush=True)
        return
    where = Path(spy_dir or tempfile.mkdtemp(prefix="spy-batch-"))
    where.mkdir(parents=True, exist_ok=True)
    done: list = []
    worker = threading.Thread(target=lambda: done.append(data(engines, config_dict, out, n, clients)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 600
    while not list((out / "data").glob("*.parquet")) and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    spies = []
    for pid, name in engine_processes().items():
        raw = where / re.sub(r"[^A-Za-z0-9_.-]", "_", f"data-{name}-{pid}.txt")
        spies.append((name, raw, subprocess.Popen(
            [binary, "record", "-p", str(pid), "-o", str(raw), "-f", "raw", "-r", "250", "-d", str(int(seconds)),
             "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    worker.join()
    for _, _, proc in spies:
        proc.wait()
    print(f"\nSPY data ({'own engine' if engines is None else f'{clients} client(s)'}): {done}", flush=True)
    for name, raw, _ in spies:
        if raw.exists() and raw.stat().st_size:
            print(f"[{name}] {raw.name}\n{spy_summary(raw, top)}", flush=True)


METHODS = ("local-loop", "local-chunk", "data", "data-own", "data-own-1", "plain")


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
    parser.add_argument("--methods", default="local-loop,local-chunk,data",
                        help=f"comma-separated, of {','.join(METHODS)}")
    parser.add_argument("--saves", choices=("all", "one"), default="all",
                        help="all: 4 layers' last-token residual + the logits; one: layer 1's (issue 51's form)")
    parser.add_argument("--arch", default=None, help="nnsight_ray.models arch (default: llama; llama-1b on a GPU)")
    parser.add_argument("--clients", type=int, default=1, help="data: client actors attached to the engines")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25, help="each engine's share (GPU)")
    parser.add_argument("--model-dir", help="checkpoint (built if missing); default a temp dir")
    parser.add_argument("--json", help="write the numbers here as JSON")
    parser.add_argument("--spy", type=float, default=0, metavar="S",
                        help="after the rounds, one more data run (data-own if data is not among --methods) "
                             "with py-spy on every process for S seconds of its steady part")
    parser.add_argument("--spy-dir", default="")
    parser.add_argument("--spy-bin", default="")
    parser.add_argument("--spy-top", type=int, default=20)
    args = parser.parse_args()

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from nnsight_ray.batch.config import validate
    from nnsight_ray.batch.preflight import prepare
    from nnsight_ray.models import ensure_model

    import torch

    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; of {METHODS}")
    on_gpu = torch.cuda.is_available()
    arch = args.arch or ("llama-1b" if on_gpu else "llama")
    work = Path(tempfile.mkdtemp(prefix="bench_batch_"))
    model_dir = str(ensure_model(args.model_dir or work / "model", arch=arch))
    texts = prompts(args.prompts)
    (work / "prompts.txt").write_text("\n".join(texts) + "\n")
    if on_gpu:
        engine_kwargs = {"max_model_len": 256, "dtype": "bfloat16",
                         "gpu_memory_utilization": args.gpu_memory_utilization}
    else:
        engine_kwargs = {"max_model_len": 256, "dtype": "float32", "kv_cache_memory_bytes": KV_BYTES}
    config = {
        "model": {"path": model_dir},
        "engine": {"tensor_parallel_size": args.tp, "pipeline_parallel_size": args.pp,
                   "placement_strategy": "SPREAD", "engine_kwargs": engine_kwargs,
                   **({"gpus_per_rank": args.gpu_memory_utilization} if on_gpu else {})},
        "prompts": {"path": str(work / "prompts.txt")},
        "saves": ([{"location": f"model.layers.{i}.output"} for i in range(4)] + [{"location": "logits"}]
                  if args.saves == "all" else [{"location": "model.layers.1.output"}]),
        "output": {"dir": str(work / "out")},
    }
    runner = {k: v for k, v in (("prompts_per_trace", args.prompts_per_trace),
                                ("max_in_flight", args.max_in_flight)) if v}
    if runner:
        config["runner"] = runner
    prepared = prepare(validate(config))
    fn = prepared.fn

    if on_gpu:  # one raylet holding the card: the RayVLLM's rank and the plain processor take a share each
        import ray

        cluster = None
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 4), include_dashboard=False,
                 log_to_driver=False)
        share = {"gpus_per_rank": args.gpu_memory_utilization}
        bundle = {"CPU": 1, "GPU": args.gpu_memory_utilization}
    else:
        from nnsight_ray._internal.cluster.local_cluster import LocalCluster

        cluster = LocalCluster(args.nodes, cpus_per_node=2, log_to_driver=False)
        share, bundle = {}, {"CPU": 1}
    from nnsight_ray import LocalVLLM, RayVLLM

    local_kwargs = dict(engine_kwargs)
    if args.tp * args.pp > 1:
        local_kwargs.update(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                            distributed_executor_backend="ray", placement_strategy="SPREAD")
    local, local_start = None, 0.0
    if {"local-loop", "local-chunk"} & set(methods):
        t = time.monotonic()
        local = LocalVLLM(model_dir, dispatch=True, **local_kwargs)
        local_start = time.monotonic() - t
    t = time.monotonic()
    # Running engines only for `data` (data-own and plain start their own inside each run).
    engines = [RayVLLM(model_dir, name=f"bench-{i}", tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                       placement_strategy="SPREAD", **share, **engine_kwargs)
               for i in range(args.replicas)] if "data" in methods else []
    ray_start = time.monotonic() - t
    tuning = prepared.config.runner
    in_flight = max(1, tuning.max_in_flight // tuning.prompts_per_trace)
    results: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, list[float]] = {m: [] for m in methods}
    stage: dict[str, list[dict[str, float]]] = {m: [] for m in methods if m.startswith("data")}
    rises: dict[str, list[float]] = {m: [] for m in methods}
    # Tokens a prompt costs the engine: its prompt tokens and the one generated token (max_tokens=1).
    tokens_per_prompt = (sum(len(ids) for ids in prepared_tokenizer(model_dir)(texts)["input_ids"]) / len(texts)) + 1
    steadies: dict[str, list[float]] = {m: [] for m in methods if m.startswith(("data", "plain"))}
    runs = {
        "local-loop": lambda r: (local_loop(local, texts, fn), None),
        "local-chunk": lambda r: (local_chunk(local, texts, fn, args.chunk), None),
        "data": lambda r: data(engines, config, work / f"data{r}", len(texts), args.clients),
        "data-own": lambda r: data(None, config, work / f"own{r}", len(texts)),
        "data-own-1": lambda r: data(None, {**config, "runner": {**config.get("runner", {}), "max_in_flight":
                                                                 tuning.prompts_per_trace}},
                                     work / f"own1-{r}", len(texts)),
        "plain": lambda r: plain(model_dir, engine_kwargs, work / "prompts.txt", work / f"plain{r}", len(texts),
                                 tuning.prompts_per_trace, in_flight, bundle),
    }
    try:
        # Warm-up: first traces pay lazy imports and allocations.
        if local is not None:
            local_loop(local, texts[:8], fn)
        if engines:
            data(engines, config, work / "warm-data", len(texts), args.clients)
        for r in range(args.rounds):
            for method in list(methods):
                try:
                    with PeakRSS() as memory:
                        whole, rate, *phases = runs[method](r)  # a Ray Data run's: the stage's phases too
                    peaks[method].append(memory.peak)
                    rises[method].append(memory.peak - memory.start)
                except Exception as error:  # the plain processor may not start on this host: report, go on
                    if method != "plain":
                        raise
                    print(f"plain failed, dropped: {type(error).__name__}: {str(error)[:500]}", flush=True)
                    methods.remove(method)
                    results.pop(method)
                    steadies.pop(method)
                    peaks.pop(method)
                    rises.pop(method)
                    continue
                results[method].append(whole)
                if method in stage and phases:
                    stage[method].append(phases[0])
                if method in steadies and rate is not None:
                    steadies[method].append(rate)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items()) + " prompts/s; "
                  "steady " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in steadies.items() if v), flush=True)
            for key, runs_ in stage.items():  # each round's phases now: a host taken back keeps what it printed
                if runs_:
                    print(f"  {key} phases: " + ", ".join(f"{p} {runs_[-1].get(p, float('nan')) * 1e3:.1f} ms"
                                                          for p in PHASES), flush=True)
        if args.spy:
            spy_data(engines if "data" in methods else None, config, work / "spy", len(texts), args.clients,
                     args.spy, args.spy_top, args.spy_dir, args.spy_bin)
    finally:
        for engine in engines:
            engine.shutdown()
        if local is not None:
            local.shutdown()
        if cluster is not None:
            cluster.shutdown()

    best = {k: max(v) for k, v in results.items()}
    median = {k: statistics.median(v) for k, v in results.items()}
    steady_median = {k: statistics.median(v) for k, v in steadies.items() if v}
    layout = (f"TP={args.tp} PP={args.pp}, {args.replicas} replica(s), "
              f"{'1 raylet with the GPU' if on_gpu else f'{args.nodes} raylets'}, "
              f"{tuning.prompts_per_trace} prompts a batch x {in_flight} batches in flight")
    print()
    saved = "4 layer residuals + logits" if args.saves == "all" else "one layer's residual"
    print(f"{args.prompts} prompts, {arch}, {saved} per prompt, {layout}, {args.rounds} rounds")
    print(f"engine start: LocalVLLM {local_start:.1f} s, RayVLLM {ray_start:.1f} s (excluded; plain's is included "
          "in its whole-run rate)")
    print(f"{tokens_per_prompt:.1f} tokens a prompt (prompt + generated); driver peak RSS per method")
    print(f"{'method':<12} {'best':>8} {'median':>8} {'steady':>8} prompts/s | {'median':>9} {'steady':>9} tokens/s"
          f" | driver peak MB (rise)")
    for key in results:
        rate = steady_median.get(key, float("nan"))
        print(f"{key:<12} {best[key]:>8.1f} {median[key]:>8.1f} {rate:>8.1f}           | "
              f"{median[key] * tokens_per_prompt:>9.0f} {rate * tokens_per_prompt:>9.0f}          | "
              f"{max(peaks[key]):>6.0f} ({max(rises[key]):+.0f})")
    if any(stage.values()):
        print("engine stage per batch, medians over rounds: mean seconds by phase; batches in flight (steady)")
        for key, runs_ in stage.items():
            if runs_:
                cells = ", ".join(f"{p} {statistics.median(r.get(p, float('nan')) for r in runs_) * 1e3:.1f} ms"
                                  for p in PHASES)
                flight = [r["in_flight"] for r in runs_ if "in_flight" in r]
                print(f"  {key:<10} {cells}; {statistics.median(flight) if flight else float('nan'):.2f} in flight")
    ratio = None
    if local is not None and "data" in best:
        ratio = best["data"] / max(best.get("local-loop", 0), best.get("local-chunk", 0))
        print(f"data / best local = {ratio:.2f}x")
    ratios = {}
    for a, b in (("data", "plain"), ("data-own", "plain"), ("data-own", "data"), ("data-own-1", "data")):
        if results.get(a) and results.get(b):
            ratios[f"{a}/{b}"] = statistics.median(x / y for x, y in zip(results[a], results[b]))
        if steadies.get(a) and steadies.get(b):
            ratios[f"{a}/{b} steady"] = statistics.median(x / y for x, y in zip(steadies[a], steadies[b]))
    for key, value in ratios.items():
        print(f"{key} = {value:.2f}x (median of per-round ratios)")
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": args.prompts, "arch": arch, "saves": args.saves,
                                               "layout": layout,
                                               "rounds": results, "steady": steadies, "best": best,
                                               "median": median, "steady_median": steady_median,
                                               "tokens_per_prompt": tokens_per_prompt, "driver_peak_mb": peaks, "driver_rise_mb": rises,
                                               "data_over_local": ratio, "ratios": ratios, "stage": stage}, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
