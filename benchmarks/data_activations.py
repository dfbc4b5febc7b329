"""Activation datasets from nnsight_ray.data: the ranks' own safetensors writer vs a Ray Data datasink, GB/s.

Issue 51 asks for activation datasets (one row per prompt token, token-major)
from the Ray Data stage, by whichever of two paths measures faster:

- ``rank``: the ranks write safetensors themselves, the fast path of today's
  batch runner (``RayVLLM.extract_async`` per part of ``--part`` prompts, all
  parts in flight, then ``extract_commit`` of each; every prompt token's value
  at each location, from the ranks' host buffers straight to the file). The
  stage would emit only the manifest rows (part, file, rows).
- ``plain``: the same requests on the same ``RayVLLM`` as plain generation
  (nothing captured or written): the floor of ``rank``'s engine.
- ``stage``: what a batch run does (``output.format: activations``):
  ``nnsight_ray.data``'s processor in its activation mode, attached to the
  same running ``RayVLLM`` by name (``engine_name``), a batch of ``--part``
  prompts per part and every part in flight: the ranks write the files, the
  stage emits one row per prompt naming them.
- ``sink``: the values travel as Ray Data rows: ``nnsight_ray.data``'s
  processor with ``saves`` of ``tokens: all`` (one ``(tokens, hidden)`` array
  per prompt and location), ``flat_map`` to one row per token, and a
  ``Datasink`` writing each write task's rows as one safetensors file
  (one tensor per location, token-major, plus the prompt index and position).

Same model, engine settings, prompts (``--prompts`` token-id prompts of
``--prompt-len`` tokens, one greedy token each) and locations (every decoder
layer's output). Engine start-up is left out of both: ``rank`` runs on an
engine already up (from its first ``extract_async`` to its last commit);
``stage`` attaches a client actor and ``sink`` starts its engine inside the
pipeline, so their seconds run from the start of the first batch's trace (a
row's postprocess time less the trace's ``time_taken_llm``) to the last row
(``stage``) or the end of the last write task (``sink``). GB/s is the bytes of
tensor data in the files written over those seconds. Each round runs every
path of ``--paths`` in turn (its files are deleted once counted); medians are
reported, and ``stage/rank`` as the median of per-round ratios. On a bf16
model the datasink's rows are float32 (numpy has no bfloat16): twice the
rank's bytes.

Usage::

    python -m benchmarks.data_activations [--prompts N] [--prompt-len L] [--part P] [--rounds R]
                                          [--paths plain,rank,stage,sink] [--model-dir DIR] [--json PATH]
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
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
# On a GPU host both engines share the one card (the rank path's stays up while the sink's runs): bf16, each at
# this share of the card's memory and of its GPU resource.
GPU_SHARE = 0.4
GPU_ENGINE = dict(dtype="bfloat16", max_model_len=256, gpu_memory_utilization=GPU_SHARE)


def token_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """Deterministic prompts of ``length`` token ids (no tokenizer differences between the paths)."""
    return [[1 + (i * 31 + j * 7) % (vocab - 1) for j in range(length)] for i in range(n)]


def tensor_bytes(directory: Path) -> int:
    """Bytes of tensor data in every safetensors file under ``directory`` (file size less the header)."""
    import struct

    total = 0
    for path in directory.rglob("*.safetensors"):
        with open(path, "rb") as handle:
            header = struct.unpack("<Q", handle.read(8))[0]
        total += path.stat().st_size - 8 - header
    return total


def rank_path(model, prompts, locations, part: int, out: Path | None) -> float:
    """Seconds to extract and commit every part of ``prompts`` on a running ``RayVLLM``, all parts in flight.

    ``out=None``: the same requests as plain generation (no capture, nothing
    written), the engine's own floor for these prompts.
    """
    import ray
    from vllm import SamplingParams

    engine = model.vllm_entrypoint
    start = time.perf_counter()
    names, refs = [], []
    for first in range(0, len(prompts), part):
        name = f"part-{first // part:05d}"
        chunk = [{"prompt_token_ids": p} for p in prompts[first:first + part]]
        if out is None:
            refs.append(engine.generate_async(chunk, [SamplingParams(max_tokens=1, temperature=0.0,
                                                                      detokenize=False)] * len(chunk)))
        else:
            refs.append(engine.extract_async(chunk, name, str(out), locations,
                                             indices=list(range(first, first + len(chunk)))))
        names.append(name)
    for ref in refs:
        engine.wait(ref)
    if out is not None:
        ray.get([ref for name in names for ref in engine.extract_commit(name)])
    return time.perf_counter() - start


def safetensors_sink(directory: str, locations: list[str]):
    """A Ray Data ``Datasink``: each write task's token rows as one safetensors file, token-major.

    Each task returns ``(earliest row start, its end time)``; ``on_write_complete``
    (in the driver) keeps them as ``spans``.
    """
    from ray.data import Datasink

    class Sink(Datasink):
        spans: list = []

        def write(self, blocks, ctx):
            import numpy as np
            import torch
            from ray.data.block import BlockAccessor
            from safetensors.torch import save_file

            tables = [t for t in (BlockAccessor.for_block(b).to_numpy() for b in blocks) if len(t["prompt"])]
            if not tables:
                return None
            tensors = {name: torch.from_numpy(np.ascontiguousarray(np.concatenate([t[name] for t in tables])))
                       for name in ["prompt", "position", *locations]}
            save_file(tensors, os.path.join(directory, f"part-{ctx.task_idx:05d}.safetensors"))
            return (min(float(t["started"].min()) for t in tables), time.time())

        def on_write_complete(self, write_result):
            type(self).spans = [span for span in write_result.write_returns if span is not None]

    return Sink()


def sink_path(model_dir: str, prompts, locations, part: int, out: Path, engine: dict, gpus: float | None) -> float:
    """Seconds of the Ray Data pipeline from its first trace to its last write (engine start left out)."""
    import numpy as np
    import ray

    from nnsight_ray.data import NNsightEngineProcessorConfig, build_processor

    config = NNsightEngineProcessorConfig(model_source=model_dir, engine_kwargs=dict(engine), concurrency=1,
                                          num_gpus=gpus,
                                          batch_size=part, saves=[{"location": loc, "tokens": "all"}
                                                                  for loc in locations])
    processor = build_processor(
        config, preprocess=lambda row: {"tokenized_prompt": row["ids"], "sampling_params": {"max_tokens": 1}},
        # when the row's batch started its trace: now, less the trace's seconds
        postprocess=lambda row: {"index": row["index"], "started": time.time() - row["time_taken_llm"],
                                 **{loc: row[loc] for loc in locations}},
        builder_kwargs={"check": False})

    def per_token(row):
        return [{"prompt": np.int64(row["index"]), "position": np.int64(t), "started": row["started"],
                 **{loc: row[loc][t] for loc in locations}} for t in range(row[locations[0]].shape[0])]

    sink = safetensors_sink(str(out), locations)
    processor(ray.data.from_items([{"index": i, "ids": p} for i, p in enumerate(prompts)])).flat_map(
        per_token).write_datasink(sink)
    spans = type(sink).spans
    return max(end for _, end in spans) - min(start for start, _ in spans)


def stage_path(model, model_dir: str, prompts, locations, part: int, out: Path) -> float:
    """Seconds of the processor's activation mode on the running ``model``, first part's start to the last row."""
    import ray

    from nnsight_ray.data import NNsightEngineProcessorConfig, build_processor

    parts = -(-len(prompts) // part)
    config = NNsightEngineProcessorConfig(model_source=model_dir, engine_name=model.name, concurrency=1,
                                          batch_size=part, max_concurrent_batches=parts,
                                          activations={"dir": str(out), "locations": list(locations)})
    processor = build_processor(
        config, preprocess=lambda row: {"tokenized_prompt": row["ids"], "sampling_params": {"max_tokens": 1}},
        postprocess=lambda row: {"index": row["index"], "error": row.get("__inference_error__"),
                                 "started": time.time() - row["time_taken_llm"], "ended": time.time()},
        builder_kwargs={"check": False})
    source = ray.data.from_items([{"index": i, "ids": p} for i, p in enumerate(prompts)])
    rows = processor(source.repartition(parts)).take_all()
    failed = [row["error"] for row in rows if row["error"]]
    assert len(rows) == len(prompts) and not failed, failed[:3]
    return max(row["ended"] for row in rows) - min(row["started"] for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--part", type=int, default=64, help="prompts per part (rank) and per batch (sink)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model-dir", default=None, help="a checkpoint (default: the tiny seeded Llama)")
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--paths", default="plain,rank,stage,sink",
                        help="which paths to run, comma-separated (sink writes float32 rows: twice rank's bytes on a "
                             "bf16 model, and its disk)")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - {"plain", "rank", "stage", "sink"}
    if unknown:
        parser.error(f"unknown --paths {sorted(unknown)}")

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from nnsight_ray import RayVLLM
    from nnsight_ray.models import build_model

    scratch = Path(tempfile.mkdtemp(prefix="data-activations-"))
    model_dir = args.model_dir or str(build_model(scratch / "model", arch="llama", seed=0))
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="nnsight_ray", log_to_driver=False)
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(model_dir)
    prompts = token_prompts(args.prompts, args.prompt_len, model_config.vocab_size)
    layers = model_config.num_hidden_layers
    locations = [f"model.layers.{i}.output" for i in range(layers)]
    results: dict[str, list[dict]] = {name: [] for name in paths}
    import torch

    on_gpu = torch.cuda.is_available()
    engine, gpus = (GPU_ENGINE, GPU_SHARE) if on_gpu else (ENGINE, None)

    def measured(name: str, round_: int, run) -> None:
        """Run one path into its own folder, keep (seconds, bytes), and delete the files at once (a large run
        would otherwise hold every round's files, and deleting them all at the end can outlast a time limit)."""
        out = scratch / f"{name}-{round_}"
        out.mkdir()
        try:
            seconds = run(out)
            results[name].append({"seconds": seconds, "bytes": tensor_bytes(out)})
        finally:
            shutil.rmtree(out, ignore_errors=True)

    model = RayVLLM(model_dir, **engine, **({"gpus_per_rank": gpus} if on_gpu else {}))
    try:
        rank_path(model, prompts[:args.part], locations, args.part, scratch / "warm")  # warm-up
        shutil.rmtree(scratch / "warm", ignore_errors=True)
        for round_ in range(args.rounds):
            if "plain" in paths:
                results["plain"].append({"seconds": rank_path(model, prompts, locations, args.part, None),
                                         "bytes": 0})
            if "rank" in paths:
                measured("rank", round_, lambda out: rank_path(model, prompts, locations, args.part, out))
            if "stage" in paths:
                measured("stage", round_,
                         lambda out: stage_path(model, model_dir, prompts, locations, args.part, out))
            if "sink" in paths:
                measured("sink", round_,
                         lambda out: sink_path(model_dir, prompts, locations, args.part, out, engine, gpus))
            print(f"round {round_}: " + ", ".join(f"{name} {runs[-1]}" for name, runs in results.items()),
                  file=sys.stderr)
        # Printed before the teardown: a limit that cuts the teardown keeps the numbers.
        summary = summarize(args, locations, results)
    finally:
        model.shutdown()
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def summarize(args: argparse.Namespace, locations: list[str], results: dict[str, list[dict]]) -> dict:
    """Medians per path, printed; ``stage/rank`` as the median of per-round ratios where both ran."""
    summary: dict = {"prompts": args.prompts, "prompt_len": args.prompt_len, "part": args.part,
                     "locations": locations, "rounds": results}
    for name, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        gbytes = statistics.median(r["bytes"] for r in runs) / 1e9
        summary[name] = {"median_s": round(seconds, 3), "gb": round(gbytes, 4), "gb_per_s": round(gbytes / seconds, 4),
                         "seconds": [round(r["seconds"], 3) for r in runs]}
        print(f"{name:5s} {seconds:8.2f} s  {gbytes * 1e3:8.1f} MB  {gbytes / seconds:.4f} GB/s", flush=True)
    if results.get("rank") and results.get("stage"):
        ratio = statistics.median(r["seconds"] / s["seconds"] for r, s in zip(results["rank"], results["stage"]))
        summary["stage_over_rank"] = round(ratio, 3)
        print(f"stage/rank GB/s = {ratio:.2f}x (median of per-round ratios)", flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(main())
