"""What capturing a trace's invokes costs the caller: nnsight's skip (``sys.settrace``) against nnsight_ray's
(``sys.monitoring``, ``_internal.blocks.skip``), alternated in one process.

Real nnsight, the project's tiny Llama as a ``LanguageModel`` (no engine: the caller's side of a trace is
nnsight's, whatever runs the model). Times the span from the first invoke's construction to the last
one's (``Invoker.__init__``), the capture of every invoke, per trace of ``--invokes`` invokes; then the
median of ``--runs`` traces for each skip, alternated ``--rounds`` times, and checks both give the same
saved value. Under Python 3.11 there is no ``sys.monitoring`` and traces keep nnsight's tracer: it prints that
one figure.

Usage::

    python -m benchmarks.invoke_capture [--invokes 256] [--runs 15] [--rounds 3] [--model-dir DIR]

Needs nnsight and torch only (and this repository on ``sys.path``): run it with any interpreter that has them,
e.g. ``python3.12 -m benchmarks.invoke_capture`` to see Python 3.12's cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--invokes", type=int, default=256)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-dir", default=None)
    args = parser.parse_args()

    import nnsight
    import torch
    from nnsight.intervention.tracer import InterleavingTracer, Invoker

    from nnsight_ray._internal.blocks import skip
    from nnsight_ray.models import ensure_model

    model = nnsight.LanguageModel(ensure_model(args.model_dir or tempfile.mkdtemp(), arch="llama"), dispatch=True)
    prompts = [f"prompt number {i} about things" for i in range(args.invokes)]

    class Monitored(skip._MonitoredSkip, InterleavingTracer):  # nnsight_ray's skip on LanguageModel's tracer
        def invoke(self, *a, **k):
            return skip.SkipInvoker(self, *a, **k)

    class Nnsights(InterleavingTracer):  # nnsight's own: sys.settrace
        pass

    marks: list[float] = []
    construct = Invoker.__init__

    def stamped(self, *a, **k):  # the first and the last invoke's construction
        marks[1 if marks else 0:] = [time.perf_counter()]
        construct(self, *a, **k)

    Invoker.__init__ = stamped

    def trace(tracer_cls) -> tuple[float, torch.Tensor]:
        marks.clear()
        with model.trace(tracer_cls=tracer_cls) as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):
                    h = model.model.layers[0].output[0][-1].save()
        return (marks[1] - marks[0]) * args.invokes / max(args.invokes - 1, 1), h

    def median_ms(tracer_cls) -> tuple[float, torch.Tensor]:
        trace(tracer_cls)  # warm-up
        spans, value = [], None
        for _ in range(args.runs):
            span, value = trace(tracer_cls)
            spans.append(span)
        return statistics.median(spans) * 1e3, value

    print(f"Python {sys.version.split()[0]}, nnsight {nnsight.__version__}, {args.invokes} invokes a trace, "
          f"median of {args.runs}")
    if skip.tracer_cls() is None:  # what LocalVLLM.trace and RayVLLM.trace ask: nnsight's own tracer here
        print(f"no sys.monitoring skip here (Python < 3.12 or {skip.ENV}=0): traces use nnsight's tracer; "
              f"capture of the invokes {median_ms(Nnsights)[0]:.1f} ms")
        return
    ratios = []
    for round_ in range(args.rounds):
        a, va = median_ms(Nnsights)
        b, vb = median_ms(Monitored)
        if not torch.equal(va, vb):
            raise SystemExit("the two skips saved different values")
        ratios.append(a / b)
        print(f"round {round_ + 1}: capture of the invokes: nnsight's skip {a:.1f} ms, nnsight_ray's {b:.1f} ms "
              f"({a / b:.2f}x)")
    print(f"median ratio {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
