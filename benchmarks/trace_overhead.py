"""Measure what an nnsight trace costs over a plain vLLM generate, on one LocalVLLM engine.

Builds the project's tiny seeded checkpoint (see ``nnsight_ray.models``), starts
one in-process ``LocalVLLM`` engine (vLLM's CPU build here, a GPU where there is
one) and times, after a warm-up, ``--runs`` repetitions of each of:

- ``trace``: a one-token trace that saves one decoder layer's output::

      with model.trace(prompt, temperature=0.0, max_tokens=1):
          hidden = model.model.layers[L].output.save()

- ``plain``: ``model.generate(prompt, max_tokens=1, temperature=0.0)`` of the
  same prompt, which runs the engine with no intervention attached.

The two are interleaved (trace, plain, trace, ...) so load from other processes
hits both alike. Prints the engine start time (import of vLLM + engine
construction), both medians, and their ratio. Timings on a shared machine are
noisy; compare medians, not single runs.

Usage::

    python -m benchmarks.trace_overhead [--arch llama|gpt2] [--runs N] [--warmup N]
                                           [--layer L] [--prompt TEXT] [--dtype DTYPE]
                                           [--model-dir DIR]

Example::

    .venv/bin/python -m benchmarks.trace_overhead --runs 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def _layer(model, arch: str, index: int):
    return model.model.layers[index] if arch == "llama" else model.transformer.h[index]


def trace_once(model, arch: str, layer: int, prompt: str) -> float:
    start = time.perf_counter()
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        hidden = _layer(model, arch, layer).output.save()
    elapsed = time.perf_counter() - start
    assert hidden is not None
    return elapsed


def plain_once(model, prompt: str) -> float:
    start = time.perf_counter()
    outputs = model.generate(prompt, max_tokens=1, temperature=0.0)
    elapsed = time.perf_counter() - start
    assert len(outputs[0].outputs[0].token_ids) == 1
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="llama", choices=["llama", "gpt2"])
    parser.add_argument("--runs", type=int, default=20, help="timed runs of each kind (>= 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs of each kind first")
    parser.add_argument("--layer", type=int, default=1, help="decoder layer whose output the trace saves")
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    parser.add_argument("--dtype", default="float32", help="engine dtype (vLLM picks bfloat16 on CPU by default)")
    parser.add_argument("--model-dir", default=None, help="checkpoint folder (built there if missing)")
    args = parser.parse_args(argv)
    if args.runs < 10:
        parser.error("--runs must be at least 10")

    # KV cache: LocalVLLM's CPU default (1 GiB) unless VLLM_CPU_KVCACHE_SPACE is set.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from nnsight_ray.models import ensure_model

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), f"nnsight-ray-bench-{args.arch}")
    ensure_model(model_dir, arch=args.arch, seed=0)

    t0 = time.perf_counter()
    from nnsight_ray.local import LocalVLLM  # imports vLLM

    t1 = time.perf_counter()
    model = LocalVLLM(model_dir, dispatch=True, dtype=args.dtype, max_model_len=256)
    t2 = time.perf_counter()

    for _ in range(args.warmup):
        trace_once(model, args.arch, args.layer, args.prompt)
        plain_once(model, args.prompt)

    traced, plain = [], []
    for _ in range(args.runs):
        traced.append(trace_once(model, args.arch, args.layer, args.prompt))
        plain.append(plain_once(model, args.prompt))

    counts = model.vllm_entrypoint.collective_rpc("nnsight_request_count")
    trace_ms = statistics.median(traced) * 1e3
    plain_ms = statistics.median(plain) * 1e3

    print()
    print(f"arch={args.arch} dtype={args.dtype} layer={args.layer} prompt_tokens={len(args.prompt)} "
          f"runs={args.runs} warmup={args.warmup} cores={os.cpu_count()} python={sys.version.split()[0]}")
    print(f"engine start: {t2 - t0:.1f} s (import {t1 - t0:.1f} s + LocalVLLM(..., dispatch=True) {t2 - t1:.1f} s)")
    print(f"plain generate, 1 token: median {plain_ms:.1f} ms (min {min(plain) * 1e3:.1f}, max {max(plain) * 1e3:.1f})")
    print(f"trace saving layer {args.layer}, 1 token: median {trace_ms:.1f} ms "
          f"(min {min(traced) * 1e3:.1f}, max {max(traced) * 1e3:.1f})")
    print(f"ratio trace/plain: {trace_ms / plain_ms:.2f}x (+{trace_ms - plain_ms:.1f} ms per trace)")
    print(f"requests left tracked on the ranks: {counts}")


if __name__ == "__main__":
    main()
