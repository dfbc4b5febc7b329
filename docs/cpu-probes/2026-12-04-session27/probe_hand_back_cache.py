"""The merge actor's hand-back of 256 arrived caches to the caller: Packed dump and load, ms (medians of 5)."""
import sys, pickle, time, gc, cProfile, pstats, statistics
sys.path.insert(0, __import__("os").path.dirname(__file__))
from probe_payload_stages import saves
from nnsight_ray._internal import payload
from nnsight.modeling.vllm.engines.engine import merge_collected
values = [{f"r{i}": {"saves": saves("cache"), "error": None, "registered": {}, "sequences": {}}} for i in range(256)]
shipped = payload.ship_each(values)
views = []
for one in shipped:
    oob = []; d = pickle.dumps(one, protocol=5, buffer_callback=oob.append)
    a = pickle.loads(d, buffers=[memoryview(b.raw()).toreadonly() for b in oob])
    with payload.arrived([a]):
        (entry,) = merge_collected([a]).values()
    views.append(entry["saves"]["cache"])
result = {"cache": views}
gc.freeze()
def hand_back():
    t0 = time.perf_counter()
    oob = []; d = pickle.dumps(payload.Packed(result), protocol=5, buffer_callback=oob.append)
    t1 = time.perf_counter()
    back = pickle.loads(d, buffers=[memoryview(b.raw()).toreadonly() for b in oob])
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(d), len(oob)
hand_back()
runs = [hand_back() for _ in range(5)]
print("dump ms", round(1e3*statistics.median(r[0] for r in runs),1), "load ms", round(1e3*statistics.median(r[1] for r in runs),1), "stream bytes", runs[0][2], "buffers", runs[0][3])
p = cProfile.Profile(); p.runcall(hand_back); pstats.Stats(p).sort_stats("tottime").print_stats(14)
