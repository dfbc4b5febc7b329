"""How soon the engine actor's first request of a long call reaches vLLM (``EngineCore.submit``).

    python -m benchmarks.submit      # CPU build, tiny Llama; 2,048 prompts of 256 tokens, max_tokens=1

Prints, per call (the first is a warm-up), the time from ``submit`` to the first
and the last request handed to vLLM's ``AsyncLLM`` and to the last finished:
the first is how long the GPU sits idle while the call's prompts are tokenized
(docs/performance.md).
"""
import asyncio
import os
import tempfile
import time


async def main():
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from nnsight_ray._internal.engine.core import EngineCore
    from nnsight_ray.models import ensure_model

    from .gpu.workloads import extract_prompts

    path = str(ensure_model(os.path.join(tempfile.gettempdir(), "bench-llama"), arch="llama"))
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, dtype="float32", max_model_len=512,
                                                    kv_cache_memory_bytes=256 << 20, enforce_eager=True,
                                                    enable_prefix_caching=False, disable_log_stats=True))
    texts = extract_prompts(2048, 256)
    real = llm.generate
    for run in range(3):
        added = []

        def generate(*args, **kwargs):
            added.append(time.perf_counter())
            return real(*args, **kwargs)

        llm.generate = generate
        done = asyncio.Event()
        reports = []

        def notify(batch):
            reports.extend(batch)
            if len(reports) == len(texts):
                done.set()

        core = EngineCore(llm, notify, lambda: asyncio.sleep(0, "dead"), on_dead=print)
        began = time.perf_counter()
        core.submit(f"r{run}", texts, [SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)] * len(texts))
        await done.wait()
        end = time.perf_counter()
        assert all(r.error is None for r in reports), [r.error for r in reports if r.error][:1]
        print(f"run {run}: first request added {added[0] - began:.3f} s, last {added[-1] - began:.3f} s, "
              f"all finished {end - began:.2f} s", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
