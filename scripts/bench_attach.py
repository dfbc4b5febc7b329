"""The caller's cost of one trace of N invokes, up to its requests built: state pickled once vs per invoke.

A loop of invokes that reads the same objects (the model, a layer index, a flag)
has one state for all of them; ``_internal/shared_blocks.py`` pickles it once per
attach (``_state_key``). This times, in one process and alternating, the caller's
part of a blocking trace (``with`` to the requests built: nnsight's tracing, its
``prepare``, ``LocalVLLM._attach_mediators``) with that sharing and with the state
pickled per invoke (the sharing turned off for the run by giving each attach a
cache that keeps nothing). The model is meta-only (no engine: nothing is sent),
so only the caller's CPU is measured. Prints both medians, their ratio and the
bytes of the requests' blocks, which must be equal.

Usage::

    python scripts/bench_attach.py [--invokes 256] [--runs 12] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time


class _KeepsNothing(dict):
    def __setitem__(self, key, value) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--invokes", type=int, default=256)
    parser.add_argument("--runs", type=int, default=12, help="per mode; the first two of each are warm-up")
    parser.add_argument("--model-dir", default="", help="a checkpoint (default: the tiny Llama, built in a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from nnsight.tracing.backend import Backend

    from nnsight_ray import LocalVLLM
    from nnsight_ray._internal import shared_blocks
    from nnsight_ray.models import build_model
    from nnsight_ray.refs import build

    path = args.model_dir or str(build_model(tempfile.mkdtemp(prefix="bench-attach-"), arch="llama", seed=0))
    model = LocalVLLM(path)
    texts = [f"prompt number {i} about things " * 8 for i in range(args.invokes)]
    sharing = shared_blocks.shared_reductions

    @contextlib.contextmanager
    def per_invoke(mediators):
        with sharing(mediators):
            for mediator in mediators:
                if "_nnsight_ray_blobs" in mediator.__dict__:
                    mediator._nnsight_ray_blobs = _KeepsNothing()
            yield

    class Built(Backend):
        def __call__(self, tracer):
            self.built = build(model, tracer)

    def run() -> tuple[float, int]:
        m, layer, clone, backend = model, 2, False, Built()
        began = time.perf_counter()
        with m.trace(temperature=0.0, max_tokens=32, backend=backend) as tracer:
            for text in texts:
                with tracer.invoke(text):
                    h = m.model.layers[layer].output[0][-1]
                    if clone:
                        h = h.clone()
                    h = h.save()  # noqa: F841 - the block's save
        took = (time.perf_counter() - began) * 1e3
        return took, sum(len(p.extra_args["nnsight_mediator"]) for p in backend.built.params)

    times: dict[str, list[float]] = {"shared": [], "per-invoke": []}
    sizes: dict[str, int] = {}
    try:
        for _ in range(args.runs):
            for mode in times:
                shared_blocks.shared_reductions = sharing if mode == "shared" else per_invoke
                took, sizes[mode] = run()
                times[mode].append(took)
    finally:
        shared_blocks.shared_reductions = sharing
    medians = {mode: statistics.median(ts[2:] or ts) for mode, ts in times.items()}
    for mode, ts in times.items():
        print(f"{mode:10s} median {medians[mode]:6.1f} ms (min {min(ts):.1f}) over {len(ts[2:] or ts)} runs; "
              f"blocks {sizes[mode]:,} bytes for {args.invokes} invokes")
    print(f"shared / per-invoke: {medians['shared'] / medians['per-invoke']:.2f}x")
    if sizes["shared"] != sizes["per-invoke"]:
        raise SystemExit("the requests' bytes differ between the modes")


if __name__ == "__main__":
    main()
