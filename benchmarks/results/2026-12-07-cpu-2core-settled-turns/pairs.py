"""Medians of per-turn pair ratios from the bench's --json files (throughput of A against B: B's seconds / A's).

python3 pairs.py FILE.json [...]: every two rows of the same workload, and each row's workloads against its
own generate (run k against run k: with the rounds of these runs, minutes apart no more)."""
import itertools, json, statistics, sys


def median_ratio(a, b):
    return statistics.median(tb / ta for ta, tb in zip(a, b))


for path in sys.argv[1:]:
    results = json.load(open(path))["results"]
    runs = {(engine, workload): got["seconds"] for engine, r in results.items()
            for workload, got in r.get("workloads", {}).items()}
    lines = []
    for (e1, w1), (e2, w2) in itertools.combinations(runs, 2):
        if w1 == w2 and e1 != e2:
            lines.append(f"{e1}/{e2} {w1} {median_ratio(runs[e1, w1], runs[e2, w2]):.2f}x")
    for (engine, workload) in runs:
        if workload != "generate" and (engine, "generate") in runs:
            lines.append(f"{engine} {workload}/generate {median_ratio(runs[engine, workload], runs[engine, 'generate']):.2f}x")
    print(path + ": " + "; ".join(lines))
