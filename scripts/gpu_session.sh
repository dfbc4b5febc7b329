#!/usr/bin/env bash
# The GPU host's plan, one step per call of the device tool (each under its 600 s limit); logs go to $OUT.
#
#   bash scripts/gpu_session.sh STEP     # STEP: setup | eager | graphs | tests | entrypoints
#
# After staging (docs/gpu.md, "The next GPU session's plan": re-split the chunks to 45 MiB first, so the
# tree fits beside each under the tool's 64 MiB), call the steps back to back: the host is given back after
# 30 s idle, and a fresh one costs the staging again. Seconds are what each took last time on the H200.
#   setup        the staged stack installed (once per host, ~60 s)
#   eager        issue 22's rows, interleaved with their floor (~250-340 s)
#   graphs       issue 23's rows: every-step (tracer.all()), cache (tracer.cache()), gen-shards (the same
#                layer at every step as a dataset: extract_async(generated=True), no block), trace, against
#                plain vLLM with its defaults, interleaved (~400 s)
#   tests        tests/gpu/test_gpu.py + test_graphs.py (~305-334 s)
#   entrypoints  tests/gpu/test_gpu_entrypoints.py: ray job submit, Serve over HTTP (~280 s)
set -uo pipefail
step=${1:?usage: gpu_session.sh setup|eager|graphs|tests|entrypoints}
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
if [ "$step" = setup ]; then
  bash /root/stage/gpu-host.sh setup > "$OUT/setup.log" 2>&1
  rc=$?
  tail -5 "$OUT/setup.log"
  exit $rc
fi
source /tmp/gpu-env.sh
export VLLM_USE_FLASHINFER_SAMPLER=0  # else a fresh host JIT-compiles FlashInfer's sampler for minutes
bench=(python3 scripts/bench_gpu.py --model-dir /root/m --json "$OUT/$step.json")
case "$step" in
  eager) cmd=("${bench[@]}" --engines vllm-eager,ray --workloads generate,registered,trace --repeats 7 --interleave) ;;
  graphs) cmd=("${bench[@]}" --engines vllm-defaults,ray-taps --workloads every-step,cache,gen-shards,trace --repeats 5 --interleave) ;;
  # No -x: one failure must not hide the rest of the suite's answers (session 29's first failure stopped
  # test_graphs.py from running at all); tests on a killed engine then fail fast with EngineDeadError.
  tests) cmd=(python3 -m pytest tests/gpu/test_gpu.py tests/gpu/test_graphs.py -rA -p no:cacheprovider) ;;
  entrypoints) cmd=(python3 -m pytest tests/gpu/test_gpu_entrypoints.py -x -rA -p no:cacheprovider) ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
echo "$ ${cmd[*]}" > "$OUT/$step.log"
timeout 570 "${cmd[@]}" >> "$OUT/$step.log" 2>&1
rc=$?
echo "rc=$rc" >> "$OUT/$step.log"
grep -v "Rendering\|Processed\|INFO\|WARNING" "$OUT/$step.log" | tail -60
exit $rc
