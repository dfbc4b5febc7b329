"""Requests/s of the Ray Serve deployment vs nnsight's own ``nnsight-serve`` server.

Both servers run the same engine layout (TP x PP, same engine arguments) on
this machine in one run, and are driven by the same nnsight client: a
meta-only ``LocalVLLM(path)`` sending ``model.trace(..., serve=url)``, each
trace saving one decoder layer's output and the logits::

    with model.trace(prompt, temperature=0.0, max_tokens=T, serve=url, api_key=key):
        hidden = model.model.layers[L].output[0].save()
        logits = model.logits.save()

- ``nnsight``: ``nnsight.modeling.vllm.serve.server``'s FastAPI app under
  uvicorn on 127.0.0.1, holding ``LocalVLLM(path, mode="async", dispatch=True)``
  (nnsight's ``VLLM`` on vLLM's CPU build, see docs/cpu-engine.md), in a
  subprocess of this script.
- ``ray-serve``: ``nnsight_ray.serve:build_app`` with one replica on a local
  Ray instance (Serve proxy on 127.0.0.1).

For each concurrency level, ``C`` client threads send traces back to back.
The machine this runs on is shared and its load swings by the minute, so the
two servers are measured in short alternating slices (``--slices`` of them,
``--requests`` traces each, at most ``--time-limit`` seconds each; the order
flips every slice; a pause of ``--settle`` seconds before each, while the
engine measured before it stops spinning), and each server's requests/s is its total requests over
its total time: both see the same mix of quiet and busy moments. The median
of the per-slice ratios is printed too. Each trace's values are checked
against the first ones the nnsight server returned for the same prompt.

Usage::

    python -m benchmarks.serve [--tp N] [--pp N] [--concurrency 1,16] [--slices N]
                                  [--requests N] [--max-tokens T] [--layer L]
                                  [--time-limit S] [--model-dir DIR] [--json FILE]

Example (what docs/serve.md reports)::

    .venv/bin/python -m benchmarks.serve --concurrency 1,16 --slices 6
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from . import SETTLE_S

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENGINE_KWARGS = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 256 << 20}
KEY = "bench-key"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_health(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> float:
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except Exception:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


# --------------------------------------------------------------------------- the two servers


def run_nnsight_server(model_dir: str, port: int, tp: int, pp: int) -> None:
    """Child mode: nnsight's own serve app on the CPU engine (what ``nnsight-serve`` does).

    anyio's asyncio backend is imported before the model is built: anyio
    imports it lazily, at the first request, and by then nnsight has added a
    ``save`` attribute that anyio's ``TypedAttributeSet`` subclass check refuses
    ("Attribute 'save' is missing its type annotation"), so every request of a
    stock ``nnsight-serve`` process fails with a 500 in this environment.
    """
    import anyio._backends._asyncio  # noqa: F401  (see the docstring)
    import anyio.abc  # noqa: F401
    import uvicorn
    from nnsight.modeling.vllm.serve import server
    from nnsight.modeling.vllm.serve.cli import _add_api_key_middleware

    from nnsight_ray import LocalVLLM

    model = LocalVLLM(model_dir, mode="async", dispatch=True, tensor_parallel_size=tp,
                      pipeline_parallel_size=pp, **ENGINE_KWARGS)
    server.set_model(model)
    _add_api_key_middleware(server.app, KEY)
    uvicorn.run(server.app, host="127.0.0.1", port=port, log_level="warning")


def start_nnsight_server(model_dir: str, tp: int, pp: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    if tp * pp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(tp * pp)))
    log = open(os.path.join(tempfile.gettempdir(), f"bench_serve_nnsight_{port}.log"), "wb")
    print(f"nnsight-serve log: {log.name}", flush=True)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])  # finds `benchmarks`
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.serve", "--_nnsight-server", model_dir, str(port), str(tp),
                             str(pp)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def start_ray(tp: int, pp: int) -> None:
    """A local Ray instance, retried: Ray gives a raylet 30 s to register, which a
    loaded machine can miss ("The current node timed out during startup")."""
    import ray

    # Ray starts its workers (the Serve proxy, replica, engine and rank actors)
    # at niceness 15, below the nnsight server's processes; on a shared machine
    # that alone decides the comparison, so both run at the default niceness.
    os.environ.setdefault("RAY_worker_niceness", "0")
    attempts = 5
    for attempt in range(attempts):
        try:
            ray.init(address="local", namespace="nnsight_ray", include_dashboard=False,
                     num_cpus=max(4, tp * pp + 2), log_to_driver=False)
            return
        except Exception as error:
            if attempt == attempts - 1:
                raise
            print(f"ray.init failed ({error}); retrying", flush=True)
            ray.shutdown()
            time.sleep(10)


def start_ray_serve(model_dir: str, tp: int, pp: int) -> str:
    from ray import serve

    from nnsight_ray.serve import build_app

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port},
                logging_config={"enable_access_log": False})
    serve.run(build_app({"model": model_dir, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                         "api_key": KEY, "engine_kwargs": ENGINE_KWARGS}), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_process_group(proc: subprocess.Popen) -> None:
    """Stop the nnsight server *and* its engine processes.

    vLLM's engine-core and worker processes outlive a SIGTERM'd uvicorn parent
    (they were seen orphaned, holding ~1.5 GB); the server runs in a session of
    its own, so its whole process group is signalled.
    """
    import signal

    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(2)  # let the children follow


# --------------------------------------------------------------------------- the client


class Client:
    """nnsight's client: a meta-only model sending traces with ``serve=url``."""

    def __init__(self, model_dir: str, layer: int, max_tokens: int) -> None:
        from nnsight_ray import LocalVLLM

        self.model = LocalVLLM(model_dir)
        self.layer = layer
        self.max_tokens = max_tokens
        self.reference: dict[str, object] = {}
        self.mismatches = 0

    def trace(self, url: str, prompt: str) -> None:
        import torch

        model = self.model
        with model.trace(prompt, temperature=0.0, max_tokens=self.max_tokens, serve=url, api_key=KEY):
            hidden = model.model.layers[self.layer].output[0].save()
            logits = model.logits.save()
        want = self.reference.setdefault(prompt, hidden)
        if hidden.shape != want.shape or not torch.allclose(hidden, want, rtol=1e-3, atol=1e-4):
            self.mismatches += 1
        assert logits is not None

    def run(self, url: str, concurrency: int, requests: int, time_limit: float) -> dict:
        """``requests`` traces from ``concurrency`` threads; requests/s over the wall time."""
        prompts = [f"request {i}: the quick brown fox" for i in range(16)]
        counter = iter(range(requests))
        lock = threading.Lock()
        done, errors = [], []
        deadline = time.monotonic() + time_limit

        def worker() -> None:
            while time.monotonic() < deadline:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                try:
                    self.trace(url, prompts[index % len(prompts)])
                    done.append(index)
                except Exception as error:  # reported, not fatal
                    errors.append(repr(error))

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        return {"requests": len(done), "errors": len(errors), "first_error": errors[0] if errors else None,
                "seconds": elapsed, "rps": len(done) / elapsed if elapsed else 0.0}


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--concurrency", default="1,16", help="comma-separated client counts")
    parser.add_argument("--slices", type=int, default=6, help="alternating measurements per server and level")
    parser.add_argument("--requests", type=int, default=None,
                        help="traces per slice (default: max(12, 3 x clients))")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per slice, at most")
    parser.add_argument("--settle", type=float, default=SETTLE_S,
                        help="seconds of pause before each slice: the engine measured before it stops spinning on a "
                             "core (vLLM's shared-memory readers spin for 1 s after their last read)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    from nnsight_ray.models import build_model

    model_dir = args.model_dir or str(build_model(os.path.join(tempfile.gettempdir(), "nnsight_ray_bench_llama"),
                                                  arch="llama", seed=0))
    print(f"model {model_dir}; layout tp={args.tp} pp={args.pp}; engine {ENGINE_KWARGS}", flush=True)

    # Both servers start together (start-up is mostly imports), then are measured in turn.
    started = time.monotonic()
    start_ray(args.tp, args.pp)
    proc, nnsight_url = start_nnsight_server(model_dir, args.tp, args.pp)
    try:
        serve_url = start_ray_serve(model_dir, args.tp, args.pp)
        wait_health(nnsight_url, args.start_timeout, proc)
        wait_health(serve_url, args.start_timeout)
        print(f"both servers ready after {time.monotonic() - started:.0f} s", flush=True)
        servers = {"nnsight": nnsight_url, "ray-serve": serve_url}

        client = Client(model_dir, args.layer, args.max_tokens)
        for name in servers:  # warm-up (and the reference values, from nnsight's server first)
            client.run(servers[name], 4, 16, args.time_limit)

        results: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in levels} for name in servers}
        for concurrency in levels:
            requests = args.requests or max(12, 3 * concurrency)
            for slice_ in range(args.slices):
                order = list(servers) if slice_ % 2 == 0 else list(reversed(servers))
                for name in order:
                    time.sleep(args.settle)  # the other server's engine stops spinning (benchmarks.gpu.turns)
                    result = client.run(servers[name], concurrency, requests, args.time_limit)
                    result["load"] = os.getloadavg()[0]
                    results[name][concurrency].append(result)
                    print(f"slice {slice_ + 1} {name:9s} c={concurrency:<3d} {result['rps']:7.2f} req/s "
                          f"({result['requests']} in {result['seconds']:.1f} s, {result['errors']} errors, "
                          f"load {result['load']:.0f})", flush=True)

        print("\nrequests/s: total requests / total time over all slices (higher is better)")
        print(f"{'clients':>8s} {'nnsight-serve':>14s} {'ray-serve':>10s} {'ratio':>6s} {'median slice ratio':>19s}")
        summary = {}
        for concurrency in levels:
            rps = {}
            for name in servers:
                runs = results[name][concurrency]
                seconds = sum(r["seconds"] for r in runs)
                rps[name] = sum(r["requests"] for r in runs) / seconds if seconds else 0.0
            ratio = rps["ray-serve"] / rps["nnsight"] if rps["nnsight"] else float("nan")
            per_slice = sorted(s["rps"] / n["rps"] for s, n in zip(results["ray-serve"][concurrency],
                                                                   results["nnsight"][concurrency]) if n["rps"])
            median = per_slice[len(per_slice) // 2] if per_slice else float("nan")
            summary[concurrency] = {**rps, "ratio": ratio, "median_slice_ratio": median}
            print(f"{concurrency:>8d} {rps['nnsight']:>14.2f} {rps['ray-serve']:>10.2f} {ratio:>6.2f} {median:>19.2f}")
        errors = sum(r["errors"] for name in servers for c in levels for r in results[name][c])
        print(f"value mismatches vs nnsight's server: {client.mismatches}; request errors: {errors}")
        loads = [r["load"] for name in servers for c in levels for r in results[name][c]]
        print(f"1-minute load average during the slices: {min(loads):.0f}-{max(loads):.0f} on {os.cpu_count()} cores")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"args": vars(args), "summary": summary, "results": results}, handle, indent=2)
    finally:
        stop_process_group(proc)
        try:
            from ray import serve

            serve.shutdown()
        except Exception:
            pass
        import ray

        ray.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_nnsight-server":
        model_dir, port, tp, pp = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        run_nnsight_server(model_dir, port, tp, pp)
    else:
        main()
