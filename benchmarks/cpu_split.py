"""Where a plain generate's CPU goes, process by process: RayVLLM against vLLM's ``AsyncLLM`` without Ray.

    python -m benchmarks.cpu_split                       # CPU build: ray, core and async rows, 10 calls each
    python -m benchmarks.cpu_split --rows ray,async --calls 20

Each row runs in a process of its own, one after the other (so rows are not paired in time: compare the
CPU-seconds a call costs in each process, which move less than wall time), with the same 256 prompts x
16 greedy tokens, vLLM's ``LLM_CLASS`` batch limits, prefix caching and chunked prefill off (as RayVLLM
runs them for nnsight) and the model in a worker process of its own:

- ``ray``: ``RayVLLM`` TP=1 on a fresh local Ray instance (engine actor, merge actor, rank actor, vLLM's
  engine-core process, Ray's daemons);
- ``core``: nnsight_ray's engine logic (``engine.core.EngineCore``: render in batches, held scheduler,
  one task a request, collection hand-off) on an ``AsyncLLM`` in this process, no Ray;
- ``async``: ``AsyncLLM`` alone, one stream a prompt, its scheduler held while a call's requests are added
  (the bench's ``vllm-async-mp-eager`` row).

Per row: the median call and the CPU-seconds every process on the machine used during the timed calls,
read from ``/proc`` before and after (processes that start and end within the window are not seen).
The machine's own threads (``kdamond``, ...) are listed too: on a 2-core machine everything shares the cores that vLLM's two busy-waiting processes (engine core
and worker or rank) keep busy.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROWS = ("ray", "core", "async")
TOKENS, PROMPTS = 16, 256
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)
# What RayVLLM sets for nnsight (a block sees every prompt whole, every token runs a forward): the rows without it too.
NNSIGHT = dict(enable_prefix_caching=False, enable_chunked_prefill=False)


def cpu_by_process() -> dict[str, tuple[float, str]]:
    """``{pid: (user + system CPU-seconds, name)}`` for every process readable in ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as handle:
                name = handle.read().strip()
            if name.startswith("python"):  # a plain process: name it by its command
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    name = " ".join(handle.read().decode(errors="replace").split("\0")[:3])[-60:]
        except (OSError, IndexError):
            continue
        found[pid] = ((int(fields[11]) + int(fields[12])) / tick, name)
    return found


def spent(before: dict, after: dict) -> list[tuple[str, float]]:
    """CPU-seconds by process name between two ``cpu_by_process`` readings, largest first."""
    by_name: dict[str, float] = {}
    for pid, (cpu, name) in after.items():
        used = cpu - before.get(pid, (0.0, name))[0]
        if used > 0:
            by_name[name] = by_name.get(name, 0.0) + used
    return sorted(by_name.items(), key=lambda item: -item[1])


def sampling():
    from vllm import SamplingParams

    from .gpu.workloads import params

    return SamplingParams(**params(TOKENS))


def ray_row(path: str):
    from nnsight_ray import RayVLLM

    from .gpu.workloads import local_ray

    local_ray()  # the row's Ray instance listens on 127.0.0.1 only
    model = RayVLLM(path, name=f"split-{os.getpid()}", **ENGINE)
    params = sampling()

    def call(texts):
        return model.vllm_entrypoint.generate(texts, params)

    def stop():
        import ray

        model.shutdown()
        ray.shutdown()

    return call, stop


def async_row(path: str, entrypoint: str = "AsyncEntrypoint"):
    """``AsyncLLM`` alone (``AsyncEntrypoint``), or with nnsight_ray's engine logic on it (``CoreEntrypoint``):
    the bench's ``vllm-async-mp-eager`` and ``core-async-mp-eager`` rows."""
    from .gpu import workloads

    engine = getattr(workloads, entrypoint)(path, distributed_executor_backend="mp", enforce_eager=True,
                                            disable_log_stats=True, **NNSIGHT, **ENGINE)
    params = sampling()

    def call(texts):
        return engine.generate(texts, params)

    return call, engine.engine.shutdown


def child(row: str, calls: int) -> None:
    from nnsight_ray.models import ensure_model

    from .gpu.workloads import prompts

    path = str(ensure_model(os.path.join(tempfile.gettempdir(), "bench-llama"), arch="llama"))
    rows = {"ray": ray_row, "core": lambda path: async_row(path, "CoreEntrypoint"), "async": async_row}
    call, stop = rows[row](path)
    texts = prompts(PROMPTS)
    for _ in range(3):  # warm-up
        call(texts)
    time.sleep(2)
    before, began = cpu_by_process(), time.perf_counter()
    walls = []
    for _ in range(calls):
        start = time.perf_counter()
        outputs = call(texts)
        walls.append(time.perf_counter() - start)
        assert len(outputs) == PROMPTS and all(len(o.outputs[0].token_ids) == TOKENS for o in outputs)
    window = time.perf_counter() - began
    used = spent(before, cpu_by_process())
    print(f"ROW {row}: {calls} calls of {PROMPTS} x {TOKENS}, median call {statistics.median(walls) * 1e3:,.0f} ms "
          f"({PROMPTS * TOKENS / statistics.median(walls):,.0f} tok/s)", flush=True)
    total = sum(cpu for _, cpu in used)
    for name, cpu in used:
        if cpu / calls >= 0.001:
            print(f"  {cpu / calls * 1e3:8.1f} ms a call   {name}", flush=True)
    print(f"  {total / calls * 1e3:8.1f} ms a call   all processes ({total / window:.2f} cores busy)", flush=True)
    stop()
    os._exit(0)  # vLLM's and Ray's shutdown are not what is measured


def run_row(row: str, calls: int) -> list[str]:
    """One row in a process group of its own, ended whole afterwards (vLLM's and Ray's children included,
    so no row runs beside the last one's leftovers); its report lines, or why it failed."""
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.cpu_split", "--child", row, "--calls", str(calls)],
                                 stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            child.wait(timeout=900)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
        log.seek(0)
        text = log.read()
    lines = [line for line in text.splitlines() if line.startswith("ROW") or " ms a call " in line]
    return lines or [f"ROW {row} failed (exit {child.returncode}):", text[-3000:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.calls)
    for row in args.rows.split(","):
        if row not in ROWS:
            raise SystemExit(f"unknown row {row!r}: one of {ROWS}")
        print("\n".join(run_row(row, args.calls)), flush=True)


if __name__ == "__main__":
    main()
