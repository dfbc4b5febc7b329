import cProfile, pstats, pickle, time, torch, gc
from nnsight_ray._internal import payload
from nnsight.modeling.vllm.engines.engine import merge_collected
HIDDEN=2048
make = lambda: torch.randn(4, HIDDEN, dtype=torch.bfloat16)[-1]
values = [{f"r{i}": {"saves": {"h": [make() for _ in range(32)]}, "error": None, "registered": {}, "sequences": {}}} for i in range(256)]
gc.freeze()
def go():
    t0=time.perf_counter()
    shipped = payload.ship_each(values)
    t1=time.perf_counter()
    data=[]
    for s in shipped:
        oob=[]
        data.append((pickle.dumps(s, protocol=5, buffer_callback=oob.append), oob))
    t2=time.perf_counter()
    arrived=[pickle.loads(d, buffers=[memoryview(b.raw()).toreadonly() for b in oob]) for d, oob in data]
    t3=time.perf_counter()
    n=0
    for one in arrived:
        with payload.arrived([one]):
            (entry,) = merge_collected([one]).values()
        n+=len(entry["saves"]["h"])
    t4=time.perf_counter()
    return [round(1e3*x,1) for x in (t1-t0,t2-t1,t3-t2,t4-t3)]
for _ in range(3): print(go())
cProfile.run("go()", "/tmp/sp.prof")
pstats.Stats("/tmp/sp.prof").sort_stats("tottime").print_stats(18)
