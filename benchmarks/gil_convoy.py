"""A batch's saved values to numpy, tensor by tensor against all at once, in a process whose other threads are busy.

The Ray Data engine stage turns each batch's saved values into row columns on a
waiting thread while the actor's tracing thread builds the next traces and other
threads collect. Every torch call releases the GIL; while another thread runs
Python, each reacquire waits up to a switch interval (5 ms). This times
``host_arrays`` on one tensor at a time (a few torch calls per row) against one
call for the whole batch (a few per batch), side by side, with the process idle
and with ``--busy`` threads running pure Python. Shapes: one batch of the
Ray Data bench (32 rows, one 2048-wide residual each), float32 and bfloat16.

    python -m benchmarks.gil_convoy [--rows 32] [--width 2048] [--busy 1] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gil_convoy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--busy", type=int, default=1, help="threads running pure Python during the busy rows")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import torch

    from nnsight_ray.data.columns import host_arrays

    stop = threading.Event()

    def spin() -> None:
        total = 0
        while not stop.is_set():
            for i in range(1000):
                total += i

    def timed(fn, tensors) -> float:
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn(tensors)
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    def each(tensors) -> None:
        for tensor in tensors:
            host_arrays([tensor])

    print(f"{args.rows} rows x {args.width}, median of {args.repeats}: ms per batch")
    print(f"{'process':<14} {'dtype':<10} {'per tensor':>11} {'batched':>9} {'ratio':>7}")
    for label in ("idle", f"{args.busy} busy"):
        threads = []
        if label != "idle":
            threads = [threading.Thread(target=spin, daemon=True) for _ in range(args.busy)]
            for thread in threads:
                thread.start()
        for dtype in (torch.float32, torch.bfloat16):
            # Views of one host buffer, as collection hands a batch's values to the stage.
            whole = torch.randn(args.rows * args.width).to(dtype)
            tensors = [whole[i * args.width:(i + 1) * args.width] for i in range(args.rows)]
            one, batched = timed(each, tensors), timed(host_arrays, tensors)
            print(f"{label:<14} {str(dtype).removeprefix('torch.'):<10} {one * 1e3:>11.2f} {batched * 1e3:>9.2f} "
                  f"{one / batched:>6.1f}x")
        stop.set()
        for thread in threads:
            thread.join()
        stop.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
