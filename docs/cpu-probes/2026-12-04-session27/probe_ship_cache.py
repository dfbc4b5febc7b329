import cProfile, pstats, pickle, time, torch, gc, sys
from nnsight_ray._internal import payload
from nnsight.modeling.vllm.engines.engine import merge_collected
from nnsight.intervention.cache import Cache, CacheView, Entry
HIDDEN=int(sys.argv[1]) if len(sys.argv)>1 else 64
def view():
    c = Cache.__new__(Cache); c.model=None; c.device=None; c.dtype=None; c.detach=True; c.non_blocking=False
    c.include_output=True; c.include_inputs=False; c.targets={"model.model.layers.2"}; c._open={}
    big = torch.randn(40, HIDDEN)
    ents=[Entry(output=(big[:40], big[:40]))]
    for k in range(31):
        step=torch.randn(256, HIDDEN)
        ents.append(Entry(output=(step[5:6], step[5:6])))
    c.entries={"model.model.layers.2": ents}
    return CacheView(c, None)
values = [{f"r{i}": {"saves": {"cache": view()}, "error": None, "registered": {}, "sequences": {}}} for i in range(256)]
gc.freeze()
def go():
    t0=time.perf_counter()
    shipped = payload.ship_each(values)
    t1=time.perf_counter()
    outs=[]
    for s in shipped:
        oob=[]; d=pickle.dumps(s, protocol=5, buffer_callback=oob.append)
        outs.append(pickle.loads(d, buffers=[b.raw() for b in oob]))
    t2=time.perf_counter()
    n=0
    for one in outs:
        with payload.arrived([one]):
            (entry,) = merge_collected([one]).values()
    t3=time.perf_counter()
    return [round(1e3*x,1) for x in (t1-t0,t2-t1,t3-t2)]
for _ in range(3): print(go())
cProfile.run("go()", "/tmp/cp.prof")
pstats.Stats("/tmp/cp.prof").sort_stats("tottime").print_stats(15)
