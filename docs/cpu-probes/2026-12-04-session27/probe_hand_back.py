import pickle, time, torch, statistics
from nnsight_ray._internal import payload
hidden = 2048
def make():
    # what the merge actor holds: each request's 32 rows, views of one arrived buffer per request
    vals = []
    for r in range(256):
        buf = torch.zeros(32 * hidden, dtype=torch.bfloat16)
        vals.append(list(torch.split(buf, hidden)))
    return {"h": vals}
v = make()
for _ in range(2):
    t0 = time.perf_counter(); st, tensors = payload._structure(v); t1 = time.perf_counter()
    bufs, specs = payload._pack(tensors); t2 = time.perf_counter()
    data = pickle.dumps(payload._Payload(st, bufs, specs), protocol=5, buffer_callback=(oob:=[]).append); t3 = time.perf_counter()
    out = pickle.loads(data, buffers=[b.raw() for b in oob]); t4 = time.perf_counter()
    print(f"structure {1e3*(t1-t0):.1f} ms, pack {1e3*(t2-t1):.1f}, pickle {1e3*(t3-t2):.1f}, loads {1e3*(t4-t3):.1f}, n={len(tensors)}")
