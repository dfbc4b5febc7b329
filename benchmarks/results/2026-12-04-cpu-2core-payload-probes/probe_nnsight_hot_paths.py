import os, sys, time, statistics
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import nnsight, torch
sys.path.insert(0, "scripts")
from bench_gpu import prompts, params
from nnsight_ray import LocalVLLM
from nnsight.intervention.interleaver import Interleaver
from nnsight.modeling.vllm.batching import VLLMBatcher
model = LocalVLLM("/tmp/bench-llama", dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)
texts = prompts(256)
def run():
    with model.trace(**params(32)) as tracer:
        for text in texts:
            with tracer.invoke(text):
                h = nnsight.save([])
                for _ in tracer.all():
                    h.append(model.model.layers[2].output[0][-1])
    assert len(h) == 256 and len(h[0]) == 32
orig_ready, orig_narrow = Interleaver._ready, VLLMBatcher.narrow
def fast_ready(self, provider):
    count = self.counts.get(provider, 0)
    return [m for m in self.mediators if (p := m.pending) is not None and p.provider == provider
            and p.iteration == count - m.counts_at_start.get(provider, 0)]
def fast_narrow(self, value, group):
    if type(value) is tuple and group is not None and not self.clone_reads:
        return tuple(self._narrow_tensor(t, group) if type(t) is torch.Tensor else t for t in value)
    return orig_narrow(self, value, group)
def patch(on):
    Interleaver._ready = fast_ready if on else orig_ready
    VLLMBatcher.narrow = fast_narrow if on else orig_narrow
for _ in range(2): run()
times = {False: [], True: []}
for i in range(8):
    for on in (False, True):
        patch(on); t = time.perf_counter(); run(); times[on].append(time.perf_counter() - t)
print({k: round(statistics.median(v), 3) for k, v in times.items()}, {k: [round(x, 2) for x in v] for k, v in times.items()})
