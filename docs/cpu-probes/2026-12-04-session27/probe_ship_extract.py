import pickle, time, torch, gc, statistics
from nnsight_ray._internal import payload
from nnsight.modeling.vllm.engines.engine import merge_collected
H=2048
values = [{f"r{i}": {"saves": {"h": [torch.randn(128, H, dtype=torch.bfloat16) for _ in range(4)]}, "error": None, "registered": {}, "sequences": {}}} for i in range(64)]
gc.freeze()
ts=[]
for _ in range(9):
    t0=time.perf_counter()
    shipped = payload.ship_each(values)
    t1=time.perf_counter()
    arrived=[]
    for s in shipped:
        oob=[]; d=pickle.dumps(s, protocol=5, buffer_callback=oob.append)
        arrived.append(pickle.loads(d, buffers=[memoryview(b.raw()).toreadonly() for b in oob]))
    t2=time.perf_counter()
    for one in arrived:
        with payload.arrived([one]):
            (entry,) = merge_collected([one]).values()
    t3=time.perf_counter()
    ts.append((t1-t0,t2-t1,t3-t2))
print(payload.__file__, [round(1e3*statistics.median(x),1) for x in zip(*ts)])
