"""The merge actor's hand-back to the caller of 256 arrived and merged requests (``Packed`` dump, then the
caller's load), ms, medians of 9:

    PYTHONPATH=<tree> python probe_hand_back.py every-step|cache [--profile]
"""
import os
import pickle
import sys
import time

from nnsight.modeling.vllm.engines.engine import merge_collected

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_payload_stages import measure, saves  # noqa: E402

from nnsight_ray._internal import payload  # noqa: E402


def merged(shape: str) -> dict:
    """What the merge actor holds: each request's saves, arrived (views of read-only buffers) and merged."""
    values = [{f"r{i}": {"saves": saves(shape), "error": None, "registered": {}, "sequences": {}}}
              for i in range(256)]
    out: dict = {}
    for one in payload.ship_each(values):
        oob: list = []
        data = pickle.dumps(one, protocol=5, buffer_callback=oob.append)
        arrived = pickle.loads(data, buffers=[memoryview(b.raw()).toreadonly() for b in oob])
        with payload.arrived([arrived]):
            (entry,) = merge_collected([arrived]).values()
        for name, value in entry["saves"].items():
            out.setdefault(name, []).append(value)
    return out


def hand_back(result: dict) -> tuple[float, float]:
    t0 = time.perf_counter()
    oob: list = []
    data = pickle.dumps(payload.Packed(result), protocol=5, buffer_callback=oob.append)
    t1 = time.perf_counter()
    pickle.loads(data, buffers=[memoryview(b.raw()).toreadonly() for b in oob])
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    shape = sys.argv[1]
    dump, load = measure(hand_back, merged(shape))
    print(f"{payload.__file__}: {shape} hand-back dump {dump} ms, load {load} ms")


if __name__ == "__main__":
    main()
