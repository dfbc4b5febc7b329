"""Filing (the writer thread's per-step work) at the H200 bench's shape, timed without making the tensors, and its cProfile."""
import cProfile, pstats, tempfile, time, torch
from nnsight_ray._internal import extract
with tempfile.TemporaryDirectory() as folder:
    writer = extract.Writer(0, 1, True); writer.host.mode = "cache"; extract._writer = writer
    n, p, steps, hidden = 256, 41, 31, 2048
    specs = [{"part": f"p{i // 64}", "index": i, "dir": folder, "locations": ["m.output"], "generated": True} for i in range(n)]
    first = extract.StepCapture(range(0, n * p), [(f"r{i}", i * p, p, list(range(p)), specs[i], 0) for i in range(n)], None, values={"m.output": torch.randn(n * p, hidden, dtype=torch.bfloat16)})
    caps = [extract.StepCapture(range(0, n), [(f"r{i}", i, 1, None, specs[i], p + s) for i in range(n)], None, values={"m.output": torch.randn(n, hidden, dtype=torch.bfloat16)}, wants_ids=True, ids=torch.arange(n, dtype=torch.int32)) for s in range(steps)]
    pr = cProfile.Profile(); t0 = time.perf_counter(); pr.enable()
    writer._file(first)
    t1 = time.perf_counter()
    for c in caps: writer._file(c)
    pr.disable(); t2 = time.perf_counter()
    print("prompt step ms", round(1e3*(t1-t0),1), "31 decode steps ms", round(1e3*(t2-t1),1))
    pstats.Stats(pr).sort_stats("tottime").print_stats(10)
