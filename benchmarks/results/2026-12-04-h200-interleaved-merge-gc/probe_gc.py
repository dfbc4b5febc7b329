import os, sys, time, gc, collections
import nnsight_ray
import ray
from nnsight_ray import RayVLLM

ray.init(namespace="nnsight_ray")
from nnsight_ray.models import ensure_model
path = str(ensure_model("/root/m", arch="llama-1b"))
m = RayVLLM(path, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.5)

def install(self):
    import gc, time
    self._gcl = []
    t = [0.0, 0]
    def cb(phase, info):
        if phase == "start":
            t[0] = time.monotonic()
            if info["generation"] == 2: t[1] = len(gc.get_objects(2))
        elif info["generation"] == 2:
            self._gcl.append((round((time.monotonic() - t[0]) * 1e3, 1), info["collected"], info["uncollectable"], t[1]))
    gc.callbacks.append(cb)
    return gc.get_freeze_count(), gc.get_count(), gc.get_threshold(), len(gc.get_objects())

def read(self):
    import gc, collections
    out = list(self._gcl); self._gcl.clear()
    objs = gc.get_objects()
    top = collections.Counter(type(o).__name__ for o in objs).most_common(8)
    return out, gc.get_count(), len(gc.get_objects(2)), len(objs), top, gc.get_freeze_count()

merges = m.vllm_entrypoint.merges
print("merge after start", ray.get([x.__ray_call__.remote(install) for x in merges]), flush=True)
prompts = [f"prompt {i}: " + "the quick brown fox " * (1 + i % 5) for i in range(256)]
for r in range(6):
    t = time.monotonic()
    outs = m.generate(prompts, max_tokens=32, temperature=0.0, ignore_eos=True)
    dt = time.monotonic() - t
    print("RUN", r, f"{dt:.2f}s", ray.get([x.__ray_call__.remote(read) for x in merges]), flush=True)
def refreeze(self):
    import gc
    t = time.monotonic(); gc.collect(); gc.freeze(); return round((time.monotonic() - t) * 1e3, 1), gc.get_freeze_count()
print("REFREEZE", ray.get([x.__ray_call__.remote(refreeze) for x in merges]), flush=True)
for r in range(6, 12):
    t = time.monotonic()
    outs = m.generate(prompts, max_tokens=32, temperature=0.0, ignore_eos=True)
    dt = time.monotonic() - t
    print("RUN", r, f"{dt:.2f}s", ray.get([x.__ray_call__.remote(read) for x in merges]), flush=True)
m.shutdown()
