"""The writer's cost for a generation dataset at the H200 bench's shape: 256 requests x (a 41-token prompt, then 31
decode steps), one location, hidden 2048 bfloat16, 4 parts of 64 prompts: filing every step, then the 4 commits
(serially here; the rank's writer runs them on 4 threads); then one cProfile of the 4 commits."""
import statistics, sys, tempfile, time
import torch
from nnsight_ray._internal import extract

def run(folder):
    writer = extract.Writer(0, 1, True)
    writer.host.mode = "cache"
    extract._writer = writer
    n, p, steps, hidden = 256, 41, 31, 2048
    specs = [{"part": f"p{i // 64}", "index": i, "dir": folder, "locations": ["m.output"], "generated": True}
             for i in range(n)]
    t0 = time.perf_counter()
    writer._file(extract.StepCapture(range(0, n * p), [(f"r{i}", i * p, p, list(range(p)), specs[i], 0) for i in range(n)],
                                     None, values={"m.output": torch.randn(n * p, hidden, dtype=torch.bfloat16)}))
    for s in range(steps):
        writer._file(extract.StepCapture(range(0, n), [(f"r{i}", i, 1, None, specs[i], p + s) for i in range(n)], None,
                                         values={"m.output": torch.randn(n, hidden, dtype=torch.bfloat16)}, wants_ids=True,
                                         ids=torch.arange(n, dtype=torch.int32)))
    t1 = time.perf_counter()
    for k in range(4):
        writer._commit(f"p{k}", writer.parts.pop(f"p{k}"), False)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1

with tempfile.TemporaryDirectory() as folder:
    runs = [run(folder) for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 7)]
print("file all steps ms", round(1e3 * statistics.median(r[0] for r in runs), 1),
      "| commit 4 parts ms", round(1e3 * statistics.median(r[1] for r in runs), 1))

import cProfile, pstats
with tempfile.TemporaryDirectory() as folder:
    writer = extract.Writer(0, 1, True); writer.host.mode = "cache"; extract._writer = writer
    n, p, steps, hidden = 256, 41, 31, 2048
    specs = [{"part": f"p{i // 64}", "index": i, "dir": folder, "locations": ["m.output"], "generated": True} for i in range(n)]
    writer._file(extract.StepCapture(range(0, n * p), [(f"r{i}", i * p, p, list(range(p)), specs[i], 0) for i in range(n)], None, values={"m.output": torch.randn(n * p, hidden, dtype=torch.bfloat16)}))
    for s in range(steps):
        writer._file(extract.StepCapture(range(0, n), [(f"r{i}", i, 1, None, specs[i], p + s) for i in range(n)], None, values={"m.output": torch.randn(n, hidden, dtype=torch.bfloat16)}, wants_ids=True, ids=torch.arange(n, dtype=torch.int32)))
    pr = cProfile.Profile(); pr.enable()
    for k in range(4):
        writer._commit(f"p{k}", writer.parts.pop(f"p{k}"), False)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)
