"""Per-turn pair ratios (median) from the bench's final table in each log."""
import re, statistics, sys
def rows(path):
    out = {}
    for line in open(path):
        m = re.match(r"^(\S+)\s+generate\s+[\d,]+\s+.*?0\.0\s+([\d., ]+?)(\s+steps.*)?$", line.rstrip())
        if m:
            out[m.group(1)] = [float(x) for x in m.group(2).split(",")]
    return out
pairs = [("ray", "core-actor-ray-nnsight"), ("core-actor-ray-nnsight", "core-async-ray-nnsight"),
         ("ray", "core-async-ray-nnsight"), ("core-async-ray-nnsight", "core-async-mp-nnsight"),
         ("core-async-mp-nnsight", "core-async-mp-eager"), ("core-async-mp-eager", "vllm-async-mp-eager"),
         ("ray", "vllm-async-mp-eager"), ("ray", "ray%pin1")]
for path in sys.argv[1:]:
    r = rows(path)
    got = []
    for a, b in pairs:
        if a in r and b in r:
            ratios = [tb / ta for ta, tb in zip(r[a], r[b])]
            got.append(f"{a} / {b} {statistics.median(ratios):.2f}x")
    print(path, "|", "; ".join(got))
