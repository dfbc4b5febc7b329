"""The caller's cost of one trace of N invokes: its state pickled once per attach vs once per invoke.

A loop of invokes that reads the same objects (the model, a layer index, a flag)
has one state for all of them; ``_internal/blocks/shared_blocks.py`` pickles it once per
attach (``_state_key``). This times, in one process and alternating, the same
trace with that sharing and with the state pickled per invoke (the sharing turned
off for the run by giving each attach a cache that keeps nothing):

* default: the caller's part only (``with`` to the requests built: nnsight's
  tracing, its ``prepare``, ``LocalVLLM._attach_mediators``) on the tiny Llama's
  meta model: no engine, nothing sent. ``--envoys-by-value``: every state carries
  the model's envoy tree, as a RayVLLM at PP > 1 sends it
  (``envoy_refs.same_tree_as_ranks``).
* ``--ray-pp 2``: a real RayVLLM at PP=2 (the envoys by value), blocking traces
  of one token with one save an invoke; prints the attach (the caller's timeline
  mark) and the whole trace, and checks every value came home.

Prints medians (the first two runs of each mode are warm-up), their ratio and
the bytes of the requests' blocks, which must be equal.

Usage::

    python -m benchmarks.attach [--invokes 256] [--runs 12] [--envoys-by-value] [--ray-pp 2] [--model-dir DIR]
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
    parser.add_argument("--envoys-by-value", action="store_true",
                        help="every invoke's state carries the model's envoy tree (NNSIGHT_RAY_ENVOY_REFS=0)")
    parser.add_argument("--ray-pp", type=int, default=0, metavar="P",
                        help="time whole traces on a RayVLLM at pipeline_parallel_size=P (a local Ray)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.envoys_by_value:
        os.environ["NNSIGHT_RAY_ENVOY_REFS"] = "0"

    from nnsight.tracing.backend import Backend

    from nnsight_ray._internal.blocks import shared_blocks
    from nnsight_ray._internal.observe.timeline import ATTACHED, CALLER
    from nnsight_ray.models import build_model
    from nnsight_ray.refs import build

    path = args.model_dir or str(build_model(tempfile.mkdtemp(prefix="bench-attach-"), arch="llama", seed=0))
    if args.ray_pp:
        import ray

        from nnsight_ray import RayVLLM

        ray.init(address="local", namespace="nnsight_ray", include_dashboard=False, log_to_driver=False)
        model = RayVLLM(path, name=f"bench-attach-{os.getpid()}", pipeline_parallel_size=args.ray_pp)
    else:
        from nnsight_ray import LocalVLLM

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
        """Builds the requests and stops there (the meta model has no engine)."""

        def __call__(self, tracer):
            self.built = build(model, tracer)

    def run() -> tuple[float, float, int]:
        """(attach ms, whole trace ms, the blocks' bytes or the values' count)."""
        m, layer, clone = model, 2, False
        backend = None if args.ray_pp else Built()
        began = time.monotonic()
        with m.trace(temperature=0.0, max_tokens=1 if args.ray_pp else 32,
                     **({"backend": backend} if backend else {})) as tracer:
            for text in texts:
                with tracer.invoke(text):
                    h = m.model.layers[layer].output[0][-1]
                    if clone:
                        h = h.clone()
                    h = h.save()
        took = (time.monotonic() - began) * 1e3
        attached = [e for e in CALLER.since(began) if e[1] == ATTACHED]
        attach = (attached[-1][3] - attached[-1][0]) * 1e3 if attached else float("nan")
        if backend is not None:
            return attach, took, sum(len(p.extra_args["nnsight_mediator"]) for p in backend.built.params)
        if len(h) != len(texts) or {tuple(v.shape) for v in h} != {(model.config.hidden_size,)}:
            raise SystemExit(f"{len(h)} values came home for {len(texts)} invokes")
        return attach, took, len(h)

    rows: dict[str, list[tuple[float, float, int]]] = {"shared": [], "per-invoke": []}
    try:
        for _ in range(args.runs):
            for mode in rows:
                shared_blocks.shared_reductions = sharing if mode == "shared" else per_invoke
                rows[mode].append(run())
    finally:
        shared_blocks.shared_reductions = sharing
        if args.ray_pp:
            model.shutdown()
    what = f"RayVLLM PP={args.ray_pp}, one-token traces" if args.ray_pp else "meta model, requests built"
    print(f"{what} of {args.invokes} invokes; envoys {'by value' if args.envoys_by_value or args.ray_pp else 'by reference'}")
    medians = {}
    for mode, got in rows.items():
        timed = got[2:] or got
        medians[mode] = (statistics.median(r[0] for r in timed), statistics.median(r[1] for r in timed))
        print(f"{mode:10s} attach median {medians[mode][0]:7.1f} ms, whole {medians[mode][1]:7.1f} ms "
              f"(mean {statistics.mean(r[1] for r in timed):.1f}, range {min(r[1] for r in timed):.0f}-"
              f"{max(r[1] for r in timed):.0f}) over {len(timed)} runs; "
              + (f"{got[-1][2]} values home" if args.ray_pp else f"blocks {got[-1][2]:,} bytes"))
    print(f"shared / per-invoke: attach {medians['shared'][0] / medians['per-invoke'][0]:.2f}x, "
          f"whole {medians['shared'][1] / medians['per-invoke'][1]:.2f}x")
    if not args.ray_pp and rows["shared"][-1][2] != rows["per-invoke"][-1][2]:
        raise SystemExit("the requests' bytes differ between the modes")


if __name__ == "__main__":
    main()
