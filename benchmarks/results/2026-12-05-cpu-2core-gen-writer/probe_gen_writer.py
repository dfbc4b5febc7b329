"""The writer's cost for a generation dataset: 256 requests x (a 10-token prompt, then 31 decode steps),
one location, hidden 256 float32, 4 parts of 64 prompts: filing every step, then the 4 commits.

``python probe_gen_writer.py [RUNS] [--h200] [--profile]``: ``--h200`` (session 29) takes the H200
bench's shape instead (41-token prompts, hidden 2048 bfloat16); ``--profile`` prints one cProfile of
the 4 commits after the timed runs."""
import cProfile, pstats, statistics, sys, tempfile, time
import torch
from nnsight_ray._internal import extract

H200 = "--h200" in sys.argv
SHAPE = (256, 41, 31, 2048, torch.bfloat16) if H200 else (256, 10, 31, 256, torch.float32)

def filed(folder):
    writer = extract.Writer(0, 1, True)
    writer.host.mode = "cache"
    extract._writer = writer
    n, p, steps, hidden, dtype = SHAPE
    specs = [{"part": f"p{i // 64}", "index": i, "dir": folder, "locations": ["m.output"], "generated": True}
             for i in range(n)]
    t0 = time.perf_counter()
    writer._file(extract.StepCapture(range(0, n * p), [(f"r{i}", i * p, p, list(range(p)), specs[i], 0) for i in range(n)],
                                     None, values={"m.output": torch.randn(n * p, hidden, dtype=dtype)}))
    for s in range(steps):
        writer._file(extract.StepCapture(range(0, n), [(f"r{i}", i, 1, None, specs[i], p + s) for i in range(n)], None,
                                         values={"m.output": torch.randn(n, hidden, dtype=dtype)}, wants_ids=True,
                                         ids=torch.arange(n, dtype=torch.int32)))
    return writer, time.perf_counter() - t0

def commit_all(writer):
    for k in range(4):
        writer._commit(f"p{k}", writer.parts.pop(f"p{k}"), False)

def run(folder):
    writer, filing = filed(folder)
    t1 = time.perf_counter()
    commit_all(writer)
    return filing, time.perf_counter() - t1

with tempfile.TemporaryDirectory() as top:
    counts = [a for a in sys.argv[1:] if a.isdigit()]
    # each run its own folder: a file written over the last run's would charge the commit its unlink
    runs = [run(f"{top}/{k}") for k in range(int(counts[0]) if counts else 7)]
    folder = f"{top}/profile"
    print("file all steps ms", round(1e3 * statistics.median(r[0] for r in runs), 1),
          "| commit 4 parts ms", round(1e3 * statistics.median(r[1] for r in runs), 1))
    if "--profile" in sys.argv:
        writer, _ = filed(folder)
        profile = cProfile.Profile()
        profile.runcall(commit_all, writer)
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
