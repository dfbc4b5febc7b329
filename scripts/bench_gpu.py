"""GPU throughput of interventions beside plain vLLM, side by side in one run.

Usage::

    python scripts/bench_gpu.py [--arch llama-1b] [--prompts 256] [--tokens 32]
        [--invokes 64] [--parts plain,local,nosnapshot,byvalue,ray] [--profile N] [--json OUT.json]

Examples::

    # the issue's recipe on the GPU host (random 1.2B Llama, bf16, eager):
    python scripts/bench_gpu.py
    # a quick check of the script itself on a CPU machine (tiny model, float32):
    python scripts/bench_gpu.py --arch llama --dtype float32 --prompts 16 --tokens 4 --invokes 8

Engines, one after the other (each shut down before the next starts):

* ``vllm-eager``: plain ``vllm.LLM(enforce_eager=True)`` - the floor nnsight is held to;
  ``generate`` all prompts at once, ``chunked`` in chunks of ``--invokes`` one
  after another (the batches a blocking trace of that many invokes runs in);
* ``vllm-graphs``: plain vLLM with its defaults (CUDA graphs, torch.compile), GPU only;
* ``local``: ``LocalVLLM`` (nnsight in-process);
* ``nosnapshot``: ``LocalVLLM`` with the snapshot of saved values off (``NNSIGHT_RAY_SNAPSHOT_SAVES=0``);
* ``byvalue``: ``LocalVLLM`` with every request carrying its own envoy tree, as
  nnsight sends it (``NNSIGHT_RAY_ENVOY_REFS=0``; see ``_internal/envoy_refs``);
* ``ray``: ``RayVLLM`` TP=1 (one rank actor in a GPU bundle), traces in flight together.

Workloads on each nnsight engine (``--prompts`` prompts x ``--tokens`` greedy
tokens, ``ignore_eos``, no detokenization: the model is random):

* ``prefill``: traces of ``--invokes`` invokes, each saving
  ``model.model.layers[L/2].output[0][-1]`` at prefill (the issue's workload);
* ``every-step``: the same save at every step (``tracer.all()``);
* ``registered``: a registered block (``model.edit()``) saving the same value, on plain ``generate``;
* ``generate``: plain ``generate``, no intervention at all.

Prints one row per (engine, workload) with tokens/s and the ratio to
``vllm-eager`` (and to ``local`` for ``ray``), then a one-line summary.
``--profile N`` also runs one ``prefill`` workload on ``LocalVLLM`` under
cProfile and prints its top ``N`` functions by cumulative time: where the time
goes, in the same run. It puts vLLM's engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profile sees the runner, so the
``local`` rows of such a run are for that in-process engine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's V2 runner hung at start for plain vLLM on the GPU host; nnsight uses V1 (docs/gpu.md).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


def prompts(n: int) -> list[str]:
    return [f"prompt {i}: " + "the quick brown fox jumps over the lazy dog "[: 20 + i % 20] for i in range(n)]


def params(tokens: int) -> dict:
    return dict(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def run_plain(path: str, texts: list[str], tokens: int, engine_kwargs: dict, eager: bool,
              invokes: int) -> dict[str, float]:
    """Seconds for plain ``LLM.generate``: all prompts at once, and in chunks of ``invokes`` one after another.

    The chunked row is the batching a blocking trace of ``invokes`` invokes
    gets (LocalVLLM runs one trace at a time): the floor for those rows.
    """
    from vllm import LLM, SamplingParams

    llm = LLM(path, enforce_eager=eager, **engine_kwargs)
    sp = SamplingParams(**params(tokens))
    llm.generate(texts[:8], sp, use_tqdm=False)  # warm-up
    seconds = {"generate": timed(lambda: llm.generate(texts, sp, use_tqdm=False)),
               "chunked": timed(lambda: [llm.generate(texts[i:i + invokes], sp, use_tqdm=False)
                                         for i in range(0, len(texts), invokes)])}
    llm = None  # noqa: F841  (frees the engine before the next one starts)
    _free()
    return seconds


def _free() -> None:
    gc.collect()
    try:
        import torch

        torch.cuda.empty_cache()
    except Exception:
        pass


def workloads(model, texts: list[str], tokens: int, invokes: int, layer: int, ray_mode: bool) -> dict[str, float]:
    """Seconds per workload on one nnsight engine (LocalVLLM or RayVLLM)."""
    chunks = [texts[i:i + invokes] for i in range(0, len(texts), invokes)]
    kw = params(tokens)

    def traced(every_step: bool):
        tracers = []
        for chunk in chunks:
            extra = {"blocking": False} if ray_mode else {}
            with model.trace(**kw, **extra) as tracer:
                for text in chunk:
                    with tracer.invoke(text):
                        if every_step:
                            for _ in tracer.all():
                                model.model.layers[layer].output[0][-1].save()
                        else:
                            model.model.layers[layer].output[0][-1].save()
            tracers.append(tracer)
        if ray_mode:
            for tracer in tracers:
                tracer.collect()

    from vllm import SamplingParams

    def generate():
        outputs = model.vllm_entrypoint.generate(texts, SamplingParams(**kw))
        assert len(outputs) == len(texts)

    def registered():
        with model.edit() as (tracer, edit):
            model.model.layers[layer].output[0][-1].save()
        try:
            generate()
        finally:
            edit.clear()

    traced(False)  # warm-up
    return {
        "prefill": timed(lambda: traced(False)),
        "every-step": timed(lambda: traced(True)),
        "registered": timed(registered),
        "generate": timed(generate),
    }


def profile(model, texts: list[str], tokens: int, invokes: int, layer: int, top: int) -> None:
    """One ``prefill`` workload under cProfile; its top functions by cumulative time."""
    import cProfile
    import io
    import pstats

    chunks = [texts[i:i + invokes] for i in range(0, len(texts), invokes)]
    profiler = cProfile.Profile()
    profiler.enable()
    for chunk in chunks:
        with model.trace(**params(tokens)) as tracer:
            for text in chunk:
                with tracer.invoke(text):
                    model.model.layers[layer].output[0][-1].save()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    print("\nPROFILE local prefill\n" + out.getvalue(), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="llama-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--invokes", type=int, default=64)
    parser.add_argument("--parts", default="plain,local,ray")
    parser.add_argument("--model-dir", default=None, help="reuse a checkpoint built earlier")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the top N functions of one local prefill workload under cProfile")
    args = parser.parse_args(argv)
    if args.profile:
        # The engine core in this process, so the profile sees the runner too.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch

    from nnsight_ray.models import ARCHITECTURES, ensure_model

    on_gpu = torch.cuda.is_available()
    path = str(ensure_model(args.model_dir or Path(tempfile.gettempdir()) / f"bench-{args.arch}", arch=args.arch))
    layer = ARCHITECTURES[args.arch].num_layers // 2
    texts = prompts(args.prompts)
    total_tokens = args.prompts * args.tokens
    engine_kwargs = dict(dtype=args.dtype, max_model_len=512)
    if on_gpu:
        engine_kwargs["gpu_memory_utilization"] = 0.5
    else:
        engine_kwargs["kv_cache_memory_bytes"] = 256 << 20
    parts = set(args.parts.split(","))
    seconds: dict[str, dict[str, float]] = {}
    starts: dict[str, float] = {}

    if "plain" in parts:
        seconds["vllm-eager"] = run_plain(path, texts, args.tokens, engine_kwargs, True, args.invokes)
        if on_gpu:
            seconds["vllm-graphs"] = run_plain(path, texts, args.tokens, engine_kwargs, False, args.invokes)
    # LocalVLLM variants: (row name, environment it runs under, workloads it runs)
    variants = [("local", {}, None),
                ("local-nosnapshot", {"NNSIGHT_RAY_SNAPSHOT_SAVES": "0"}, ("prefill", "every-step")),
                ("local-byvalue", {"NNSIGHT_RAY_ENVOY_REFS": "0"}, ("prefill", "every-step"))]
    wanted = {"local": "local", "local-nosnapshot": "nosnapshot", "local-byvalue": "byvalue"}
    for row, env, keep in variants:
        if wanted[row] not in parts:
            continue
        from nnsight_ray import LocalVLLM

        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            began = time.perf_counter()
            model = LocalVLLM(path, dispatch=True, **engine_kwargs)
            starts[row] = time.perf_counter() - began
            got = workloads(model, texts, args.tokens, args.invokes, layer, ray_mode=False)
            if row == "local" and args.profile:
                profile(model, texts, args.tokens, args.invokes, layer, args.profile)
            seconds[row] = {k: v for k, v in got.items() if keep is None or k in keep}
            model.shutdown()
            del model
            _free()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    if "ray" in parts:
        import ray

        from nnsight_ray import RayVLLM

        ray.init(namespace="nnsight_ray", include_dashboard=False)
        began = time.perf_counter()
        model = RayVLLM(path, name="bench-gpu", **engine_kwargs)
        starts["ray"] = time.perf_counter() - began
        seconds["ray"] = workloads(model, texts, args.tokens, args.invokes, layer, ray_mode=True)
        model.shutdown()
        ray.shutdown()

    floor = seconds.get("vllm-eager", {}).get("generate")
    print(f"\n{args.arch} {args.dtype}, {args.prompts} prompts x {args.tokens} tokens, "
          f"{args.invokes} invokes/trace, {'GPU ' + torch.cuda.get_device_name() if on_gpu else 'CPU'}")
    print(f"{'engine':<18} {'workload':<11} {'tok/s':>9} {'vs eager':>9} {'vs local':>9}")
    rows = []
    for engine, results in seconds.items():
        for workload, spent in results.items():
            if spent != spent:  # nan: not measured
                continue
            rate = total_tokens / spent
            vs_eager = floor / spent if floor else float("nan")
            local = seconds.get("local", {}).get(workload)
            vs_local = local / spent if engine == "ray" and local and local == local else float("nan")
            rows.append({"engine": engine, "workload": workload, "tokens_per_s": rate,
                         "vs_eager": vs_eager, "vs_local": vs_local})
            print(f"{engine:<18} {workload:<11} {rate:>9.0f} {vs_eager:>8.2f}x {vs_local:>8.2f}x")
    for name, spent in starts.items():
        print(f"start {name}: {spent:.1f} s")
    summary = {r["engine"] + "/" + r["workload"]: round(r["vs_eager"], 3) for r in rows}
    print("SUMMARY " + " ".join(f"{k}={v}" for k, v in summary.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "starts": starts, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
