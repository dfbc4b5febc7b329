"""Rank -> merge actor: saved values as in-band bytes (``dumps_each``) beside out-of-band buffers (``ship_each``).

Two real Ray actors on this machine: a "rank" holding finished requests' collected
entries (as a rank's stash does) and a "merge" actor that takes them with one call
and merges each with nnsight's ``merge_collected``, as ``MergeActor.finish`` does.
Timed in the merge actor: from the call to every request merged. Both forms run
alternately in one invocation; medians and their ratio are printed.

Shapes: ``every-step`` (256 requests x 32 steps of one hidden-state row, 2048 bf16:
the GPU bench's every-step workload) and ``extract`` (64 requests x 4 layers x 128
tokens x 2048 bf16, 134 MB: a trace saving whole layers).

    python -m benchmarks.payloads [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray

SHAPES = {"every-step": (256, 32, 1), "extract": (64, 4, 128)}  # requests, tensors each, rows each
HIDDEN = 2048


@ray.remote
class Rank:
    def prepare(self, shape: str) -> None:
        import torch

        requests, tensors, rows = SHAPES[shape]
        # Views into a step's output, as a block keeps them (``output[0][-1]``); whole tensors for extract.
        make = (lambda: torch.randn(4, HIDDEN, dtype=torch.bfloat16)[-1]) if rows == 1 else \
            (lambda: torch.randn(rows, HIDDEN, dtype=torch.bfloat16))
        self.values = [{f"r{i}": {"saves": {"h": [make() for _ in range(tensors)]}, "error": None,
                                  "registered": {}, "sequences": {}}} for i in range(requests)]
        import gc

        import nnsight_ray._internal.merge.payload  # noqa: F401

        gc.freeze()  # as vLLM freezes a rank's startup heap: a full collection then skips it

    def take(self, form: str) -> list:
        from nnsight_ray._internal.merge import payload

        return payload.dumps_each(self.values) if form == "bytes" else payload.ship_each(self.values)


@ray.remote
class Merge:
    def __init__(self, rank) -> None:
        import gc

        from nnsight.modeling.vllm.engines.engine import merge_collected  # noqa: F401

        import nnsight_ray._internal.merge.payload  # noqa: F401

        self.rank = rank
        gc.freeze()  # as the merge actor freezes its startup heap

    async def fetch(self, form: str) -> tuple[float, int]:
        from nnsight.modeling.vllm.engines.engine import merge_collected

        from nnsight_ray._internal.merge.payload import arrived

        began = time.perf_counter()
        taken = await self.rank.take.remote(form)
        count = 0
        for one in taken:
            with arrived([one]):
                (entry,) = merge_collected([one]).values()
            count += len(entry["saves"]["h"])
        return time.perf_counter() - began, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rank = Rank.remote()
    merge = Merge.remote(rank)
    print(f"{'shape':12s} {'bytes (ms)':>12s} {'shipped (ms)':>13s} {'ratio':>7s}  runs bytes / shipped (ms)")
    for shape, (requests, tensors, _) in SHAPES.items():
        ray.get(rank.prepare.remote(shape))
        times: dict[str, list[float]] = {"bytes": [], "shipped": []}
        for _ in range(args.repeats + 1):  # the first of each is a warm-up
            for form in times:
                seconds, count = ray.get(merge.fetch.remote(form))
                assert count == requests * tensors, (form, count)
                times[form].append(seconds)
        b, s = (statistics.median(times[f][1:]) for f in ("bytes", "shipped"))
        runs = " / ".join(", ".join(f"{t * 1e3:.0f}" for t in times[f][1:]) for f in times)
        print(f"{shape:12s} {b * 1e3:12.1f} {s * 1e3:13.1f} {b / s:6.2f}x  {runs}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
