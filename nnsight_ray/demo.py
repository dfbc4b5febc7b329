"""The main job: a batch run on a simulated multi-node Ray cluster, then a logit-lens picture.

What it does, in order (all under ``--out``, default ``./runs/demo``):

1. builds the project's seeded tiny Llama (4 layers, hidden 128) in ``model/``;
2. writes 64 demo prompts to ``prompts.jsonl`` and the run config to ``batch.yaml``;
3. starts an embedded Ray cluster of 3 raylets on 127.0.0.1 (three Ray nodes on
   this one machine), a ``RayVLLM`` engine with tensor parallelism 2 and
   ``STRICT_SPREAD`` placement, so the two ranks sit on two different nodes,
   and runs the batch on it as a Ray Data pipeline (``run_batch(config,
   engines=[llm])``): every decoder layer's last-token residual stream and the
   logits are saved as Parquet rows in ``run/data/``;
4. renders ``logit_lens.png``: each layer's residual read through the model's
   final norm and unembedding (the logit lens), next to the per-layer
   residual-stream norms of all prompts; checks that the lens at the last
   layer reproduces the engine's own logits;
5. prints where the rows, manifest and picture are.

Rerunning resumes (Ray Data's checkpoint by prompt id: written rows are kept);
``--fresh`` starts over. The weights are random, so the lens shows how a
prediction forms across layers mechanically, not anything linguistic.

Usage::

    python -m nnsight_ray.demo [--out runs/demo] [--fresh] [--verbose]
    nnsight-ray demo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["demo_prompts", "main", "render"]

NODES = 3
TENSOR_PARALLEL = 2

_TEMPLATES = [
    "The capital of {} is",
    "My favourite colour is {}, because",
    "{} + {} =",
    "def {}(x):\n    return",
    "Once upon a time, {} met a",
    "Q: What is {}?\nA:",
    "{}, {}, {},",
    "The opposite of {} is",
]
_FILLERS = [
    ["France", "Japan", "Peru", "Kenya", "Norway", "Chile", "Egypt", "Canada"],
    ["blue", "green", "red", "amber", "violet", "black", "white", "teal"],
    [("2", "2"), ("7", "5"), ("10", "32"), ("99", "1"), ("3", "4"), ("12", "12"), ("8", "0"), ("41", "1")],
    ["square", "double", "negate", "identity", "half", "cube", "inc", "sign"],
    ["a fox", "the king", "a robot", "Ada", "a cat", "the moon", "Bob", "a ghost"],
    ["Ray", "vLLM", "a tensor", "a layer", "nnsight", "a shard", "a logit", "a token"],
    [("1", "2", "3"), ("a", "b", "c"), ("x", "y", "z"), ("2", "4", "6"), ("A", "B", "C"), ("5", "10", "15"),
     ("I", "II", "III"), ("0", "1", "1")],
    ["hot", "up", "open", "early", "light", "fast", "left", "yes"],
]


def demo_prompts() -> list[dict[str, str]]:
    """The 64 demo prompts (also in ``cluster_configs/demo-prompts.jsonl``)."""
    prompts = []
    for t, (template, fillers) in enumerate(zip(_TEMPLATES, _FILLERS)):
        for f, filler in enumerate(fillers):
            text = template.format(*filler) if isinstance(filler, tuple) else template.format(filler)
            prompts.append({"id": f"t{t}-{f}", "prompt": text})
    return prompts


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in demo_prompts()))
    return path


def demo_config(out: Path, num_layers: int) -> dict[str, Any]:
    return {
        "model": {"path": str(out / "model"), "build_arch": "llama"},
        "engine": {
            "tensor_parallel_size": TENSOR_PARALLEL,
            "pipeline_parallel_size": 1,
            "placement_strategy": "STRICT_SPREAD",
            "cpus_per_rank": 1,
            "replicas": 1,
            # 64 MiB of KV cache is plenty for the tiny model (~4 KiB per token).
            "engine_kwargs": {"max_model_len": 256, "dtype": "float32", "kv_cache_memory_bytes": 64 << 20},
        },
        "prompts": {"path": str(out / "prompts.jsonl"), "id_field": "id", "text_field": "prompt"},
        "saves": [{"location": f"model.layers.{i}.output", "tokens": "last"} for i in range(num_layers)]
        + [{"location": "logits", "tokens": "last"}],
        "sampling": {"max_tokens": 1, "temperature": 0.0},
        "output": {"dir": str(out / "run"), "shard_size": 16},
    }


# --------------------------------------------------------------------------- the picture


def _read_rows(run: Path, names: list[str]) -> tuple[list[str], list[str], dict[str, Any]]:
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(sorted((run / "data").glob("*.parquet"))).sort_by("id")
    ids = table.column("id").to_pylist()
    prompts = table.column("prompt").to_pylist()
    values = {}
    for name in names:
        shapes = table.column(name + ".shape").to_pylist()
        flat = table.column(name).to_pylist()
        values[name] = np.stack([np.asarray(v, np.float32).reshape(s) for v, s in zip(flat, shapes)])
    return ids, prompts, values


def render(out: Path, num_layers: int, shown: int = 16) -> tuple[Path, float]:
    """Draw ``logit_lens.png`` from the run's rows; returns its path and the last-layer lens error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    model_dir = out / "model"
    layers = [f"model.layers.{i}.output" for i in range(num_layers)]
    ids, prompts, values = _read_rows(out / "run", layers + ["logits"])
    weights = load_file(str(model_dir / "model.safetensors"))
    eps = json.loads((model_dir / "config.json").read_text()).get("rms_norm_eps", 1e-6)
    norm_w, unembed = weights["model.norm.weight"], weights["lm_head.weight"]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def lens(h: Any) -> Any:
        normed = h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * norm_w
        return normed @ unembed.T

    def softmax(x: Any) -> Any:
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    lens_logits = np.stack([lens(values[name]) for name in layers], axis=1)  # [prompts, layers, vocab]
    engine_logits = values["logits"]
    lens_error = float(np.abs(lens_logits[:, -1] - engine_logits).max() / np.abs(engine_logits).max())
    columns = np.concatenate([lens_logits, engine_logits[:, None]], axis=1)
    probs = softmax(columns)
    final = engine_logits.argmax(-1)
    p_final = probs[np.arange(len(ids)), :, final]  # [prompts, layers+1]: P(the model's next token)
    top = probs.argmax(-1)
    norms = np.stack([np.linalg.norm(values[name], axis=-1) for name in layers], axis=0)  # [layers, prompts]

    def token(i: int) -> str:
        text = tokenizer.id_to_token(int(i)) or "?"
        return {" ": "␣", "\n": "⏎"}.get(text, text)

    rows = np.linspace(0, len(ids) - 1, min(shown, len(ids))).astype(int)
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 7.5), gridspec_kw={"width_ratios": [1, 1.5]})
    # A random-weight model is never confident: scale colours to what it reaches.
    vmax = max(0.05, float(p_final[rows].max()))
    image = left.imshow(p_final[rows], cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
    for r, row in enumerate(rows):
        for c in range(columns.shape[1]):
            colour = "black" if p_final[row, c] > 0.6 * vmax else "white"
            left.text(c, r, token(top[row, c]), ha="center", va="center", fontsize=9, color=colour)
    left.set_xticks(range(columns.shape[1]), [f"L{i}" for i in range(num_layers)] + ["logits"])
    left.set_yticks(range(len(rows)), [_label(prompts[r]) for r in rows], fontsize=8)
    left.set_title("Logit lens: P(final next token) per layer\n(cell text: the layer's top-1 token)")
    fig.colorbar(image, ax=left, fraction=0.046, pad=0.02)

    heat = right.imshow(norms, cmap="magma", aspect="auto")
    right.set_yticks(range(num_layers), [f"layer {i}" for i in range(num_layers)])
    right.set_xlabel(f"prompt (all {len(ids)}, by id)")
    right.set_title("Residual-stream norm at the last token, per layer")
    fig.colorbar(heat, ax=right, fraction=0.046, pad=0.02, label="L2 norm")
    fig.suptitle(f"nnsight_ray demo: tiny Llama, TP={TENSOR_PARALLEL} over {NODES} Ray nodes "
                 f"({len(ids)} prompts, last-layer lens vs engine logits: rel. error {lens_error:.1e})")
    fig.tight_layout()
    path = out / "logit_lens.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, lens_error


def _label(prompt: str, width: int = 30) -> str:
    text = repr(prompt)[1:-1]
    return text if len(text) <= width else "..." + text[-(width - 3):]


# --------------------------------------------------------------------------- the job


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnsight_ray.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo", help="folder for everything the demo writes (default runs/demo)")
    parser.add_argument("--fresh", action="store_true", help="delete the earlier run first instead of resuming")
    parser.add_argument("--verbose", action="store_true", help="show the engines' and Ray workers' logs")
    args = parser.parse_args(argv)

    # Before Ray is imported: every raylet and the driver bind 127.0.0.1.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")

    import yaml

    from .batch.__main__ import _logging
    from .batch.config import validate
    from ._internal.cluster.local_cluster import LocalCluster
    from .batch.pipeline import CHECKPOINT_DIR, DATA_DIR, committed_rows, run_batch
    from .batch.preflight import prepare
    from .models import ARCHITECTURES, ensure_model

    _logging(args.verbose)
    started = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.fresh and (out / "run").exists():
        shutil.rmtree(out / "run")
    num_layers = ARCHITECTURES["llama"].num_layers

    print(f"[1/4] tiny Llama checkpoint -> {out / 'model'}", flush=True)
    ensure_model(out / "model", arch="llama", seed=0)
    write_prompts(out / "prompts.jsonl")
    raw = demo_config(out, num_layers)
    (out / "batch.yaml").write_text(
        "# Written by `python -m nnsight_ray.demo`, which runs it with run_batch(config, engines=[llm]) on a TP=2\n"
        "# RayVLLM it starts (resume: run the demo again). The same config on the command line, where the run\n"
        "# starts its own engine from the engine section (an output folder of its own):\n"
        f"#   nnsight-ray batch --config {out / 'batch.yaml'} --local-cluster {NODES} --set output.dir={out / 'rows'}\n"
        + yaml.safe_dump(raw, sort_keys=False)
    )
    config = validate(raw, str(out / "batch.yaml"))
    prepared = prepare(config, str(out / "batch.yaml"))  # every input checked before the cluster starts
    done = committed_rows(prepared.run_dir.path / CHECKPOINT_DIR) >= len(prepared.prompts)

    print(f"[2/4] Ray cluster: {NODES} raylets on 127.0.0.1", flush=True)
    cluster = LocalCluster(NODES, cpus_per_node=2, log_to_driver=args.verbose)
    topology: list[dict[str, Any]] = []
    try:
        engines = []
        if not done:  # a finished run starts no engine
            from .ray_vllm import RayVLLM

            print(f"[3/4] batch: {len(demo_prompts())} prompts on a RayVLLM engine, TP={TENSOR_PARALLEL} "
                  "STRICT_SPREAD (engine start-up takes about a minute)", flush=True)
            engine = config.engine
            engines.append(RayVLLM(prepared.model_path, name="nnsight-ray-demo",
                                   tensor_parallel_size=engine.tensor_parallel_size,
                                   pipeline_parallel_size=engine.pipeline_parallel_size,
                                   **engine.placement.model_dump(exclude_defaults=True), **engine.engine_kwargs))
            topology = engines[0].topology()
        else:
            print("[3/4] batch: every prompt is done already (rerun with --fresh to start over)", flush=True)
        try:
            result = run_batch(config, prepared=prepared, engines=engines)
        finally:
            for llm in engines:
                llm.shutdown()
    finally:
        cluster.shutdown()
    print(result.summary(), flush=True)

    print("[4/4] logit lens picture", flush=True)
    picture, lens_error = render(out, num_layers)
    nodes = sorted({t["node_id"] for t in topology if t.get("node_id")})
    elapsed = time.monotonic() - started
    print()
    print(f"nnsight_ray demo done in {elapsed:.0f} s")
    if topology:
        print("  ranks:     " + ", ".join(f"tp{t['tp_rank']} on node {str(t['node_id'])[:12]}" for t in
                                      sorted(topology, key=lambda t: t["rank"]))
              + f" ({len(nodes)} distinct Ray nodes)")
    print(f"  model:     {out / 'model'}")
    print(f"  rows:      {result.output_dir / DATA_DIR}/*.parquet ({result.prompts_done} of "
          f"{result.prompts_total} prompts)")
    print(f"  manifest:  {result.manifest}")
    print(f"  picture:   {picture}")
    print(f"  check:     logit lens at the last layer vs the engine's logits, relative error {lens_error:.1e}")
    print(f"  rerun:     python -m nnsight_ray.demo --out {out}   (resumes; --fresh starts over)")
    print(f"  CLI:       nnsight-ray batch --config {out / 'batch.yaml'} --local-cluster {NODES} "
          f"--set output.dir={out / 'rows'}")
    return 0 if result.complete and lens_error < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
