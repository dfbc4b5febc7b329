"""A rank's ``ship_each``, the arrival (out of band, read-only buffers) and nnsight's ``merge_collected``,
per stage in ms (medians of 9 after a warm-up), for one shape:

    PYTHONPATH=<tree> python probe_payload_stages.py every-step|cache|extract [--profile]
"""
import cProfile
import gc
import pickle
import pstats
import statistics
import sys
import time

import torch
from nnsight.intervention.cache import Cache, CacheView, Entry
from nnsight.modeling.vllm.engines.engine import merge_collected

from nnsight_ray._internal import payload

HIDDEN = 2048


def cache_view() -> CacheView:
    """What a request's ``tracer.cache(modules=[layer])`` holds after 32 steps: a prefill, then rows."""
    cache = Cache.__new__(Cache)
    cache.__dict__.update(model=None, device=None, dtype=None, detach=True, non_blocking=False,
                          include_output=True, include_inputs=False, targets={"model.model.layers.2"}, _open={})
    prefill = torch.randn(40, HIDDEN, dtype=torch.bfloat16)
    entries = [Entry(output=(prefill, prefill.clone()))]
    for _ in range(31):
        step = torch.randn(256, HIDDEN, dtype=torch.bfloat16)
        entries.append(Entry(output=(step[5:6], step[5:6].clone())))
    cache.entries = {"model.model.layers.2": entries}
    return CacheView(cache, None)


def saves(shape: str) -> dict:
    if shape == "every-step":  # 32 rows of one step's output, views as a block keeps them
        return {"h": [torch.randn(4, HIDDEN, dtype=torch.bfloat16)[-1] for _ in range(32)]}
    if shape == "cache":
        return {"cache": cache_view()}
    return {"h": [torch.randn(128, HIDDEN, dtype=torch.bfloat16) for _ in range(4)]}  # extract


def stages(values: list) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    shipped = payload.ship_each(values)
    t1 = time.perf_counter()
    arrived = []
    for one in shipped:
        oob: list = []
        data = pickle.dumps(one, protocol=5, buffer_callback=oob.append)
        arrived.append(pickle.loads(data, buffers=[memoryview(b.raw()).toreadonly() for b in oob]))
    t2 = time.perf_counter()
    for one in arrived:
        with payload.arrived([one]):
            merge_collected([one])
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def measure(fn, *args) -> list[float]:
    """``fn(*args)``'s stage times (seconds) as ms, medians of 9 after a warm-up (and under cProfile once, with
    ``--profile``); the heap frozen first, as the product's processes freeze theirs."""
    gc.freeze()
    fn(*args)
    runs = [fn(*args) for _ in range(9)]
    if "--profile" in sys.argv:
        profiler = cProfile.Profile()
        profiler.runcall(fn, *args)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    return [round(1e3 * statistics.median(x), 1) for x in zip(*runs)]


def main() -> None:
    shape = sys.argv[1]
    count = 64 if shape == "extract" else 256
    values = [{f"r{i}": {"saves": saves(shape), "error": None, "registered": {}, "sequences": {}}}
              for i in range(count)]
    ship, arrive, merge = measure(stages, values)
    print(f"{payload.__file__}: {shape} ship {ship} ms, arrive {arrive} ms, merge {merge} ms")


if __name__ == "__main__":
    main()
