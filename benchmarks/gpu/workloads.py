"""Throughput of interventions beside plain vLLM, on equal footing: the honest benchmark (issue 22).

Usage::

    python scripts/bench_gpu.py [--engines vllm-defaults,vllm-eager,nnsight-eager,nnsight-taps,local,ray]
        [--workloads generate,registered,trace,nonblocking,every-step,cache,extract] [--prompts 256] [--tokens 32]
        [--traces 4] [--repeats 3] [--extract-prompts 256] [--extract-len 128] [--json OUT.json]

    # the GPU host (random 1.2B Llama, bf16):
    python scripts/bench_gpu.py
    # the CPU build (tiny Llama, float32): checks the script and gives the CPU ratios
    python scripts/bench_gpu.py --cpu

Equal footing:

* **Every prompt of a workload is in flight at once** on every row: plain
  ``generate`` of all of them, one trace of ``--prompts`` invokes, or
  ``--traces`` non-blocking traces submitted together (RayVLLM; a LocalVLLM
  trace blocks, so it has no such row).
* **Each engine in its own process** (a child of this script), started once,
  shut down before the next starts; its start time is a row of its own, printed
  with its place in the order (an untimed child imports the stack first,
  ``--prewarm``, so the first engine is not charged for a cold page cache).
* **Each workload: one warm-up, then ``--repeats`` timed runs; the median** is
  printed (rows of separate runs on a shared GPU differ by up to 1.7x).
* ``--interleave``: every engine's process alive at once (started one after
  another, each start alone), and their runs taken in turn: run k of every row
  before run k+1 of any, the other engines idle between their runs. A shared
  GPU's drift over minutes (session 26: plain eager 8.2k tok/s in one
  invocation, 16.1k in another) then hits every row alike. The engines split
  the GPU's memory (``--gpu-memory-utilization`` 0.85 / engines): smaller
  KV caches than alone, equal between rows. A plain row runs its floor beside each
  workload it has no row of (``generate@trace``: plain generate, in turn with
  the trace's runs), and the ratios use those runs.
* **Every workload carries its values home and checks them** (count and shape)
  before it counts: a registered block saves a *named* value (``probe``), a
  trace binds its saves (a bare ``x.save()`` binds no name and nothing would
  travel), the extraction checks every layer's rows.

Graph modes of our engines (issue 23): ``local-graphs``/``ray-graphs``
(``enforce_eager=False``: CUDA graphs on every step no block needs, eager on
the others), ``local-taps``/``ray-taps`` (``taps`` at the bench's layers:
steps whose blocks wait only on taps replay breakable graphs; raw saves, no
clone). Each workload row of an nnsight_ray engine prints how its timed steps
ran (``step_modes()``: ``graph``, ``piecewise``, ``eager_for_block``, ``eager``).

Each workload row of a RayVLLM engine also prints its last run's timeline, and
its slowest run's when that is another one
(``RayVLLM.timeline()``, ms from the call): the submit, the render batches,
when the first and last request went into vLLM, the steps (how many, how many
under half the largest, the rank's time in and between them, the first
steps' tokens), the request ends, the stash collections, the merge actors'
fetches, merges and hand-back, the result, and garbage collections of 2 ms or
more per process. The caller's own part comes first: ``attached N +a..+b`` (a
trace's requests built: nnsight's attach, our shared reductions) and ``sent
+c..+d`` (the requests handed to Ray), so a late ``submit`` reads as the
caller's work or as the way to the engine actor. ``--spy S`` profiles with py-spy (``--spy-only`` names the
processes: on 2 cores, sampling all of them slows a run several times).

Two versions of our code in one run: ``--tree old=DIR`` (a worktree of another
commit) and an engine named ``ENGINE@old`` runs that engine's child with DIR
first on ``PYTHONPATH`` and DIR its working directory (Ray puts the driver's working directory
first on its workers' path, so the actors import DIR's code too), beside the others:
``--tree old=/tmp/old --engines vllm-defaults,ray-taps,ray-taps@old``.
One engine under other settings in the same run: ``--env hostreg=PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True``
(repeat ``--env`` for several variables of one tag) and an engine named ``ENGINE%hostreg`` runs that
engine's child with those variables set (its Ray cluster, started by the child, hands them to every
actor): ``--engines ray,ray%hostreg``.

Engines: ``vllm-defaults`` (plain ``vllm.LLM`` as vLLM configures it: CUDA
graphs on a GPU), ``vllm-eager`` (plain, ``enforce_eager=True``), ``vllm-mp`` and
``vllm-ray`` (plain, defaults, but the model in a worker process of vLLM's
multiprocessing or Ray executor, as ours is; ``vllm-ray`` is GPU only), ``vllm-mp-eager``
(the same worker process, eager: the control row for the eager engines), nnsight's own
``VLLM`` eager (``nnsight-eager``) and with ``taps`` (``nnsight-taps``: CUDA
graphs with nnsight's handoff recorded at the tapped layers; its saves are
cloned, as its docs require), ``local`` (``LocalVLLM``), ``ray`` (``RayVLLM``,
TP=1). nnsight's own ``VLLM`` has no CPU build, so its rows are GPU only.

Workloads (``--prompts`` prompts x ``--tokens`` greedy tokens, ``ignore_eos``, no detokenization):

* ``generate``: plain ``generate``, no intervention (every engine);
* ``registered``: a registered block (``model.edit()``) saving ``probe`` = layer
  L/2's last-token output at prefill, on plain ``generate``; every output carries it;
* ``trace``: one trace of ``--prompts`` invokes, each saving the same value;
* ``nonblocking``: the same in ``--traces`` non-blocking traces, then collected (RayVLLM);
* ``every-step``: one trace, each invoke saving that value at every step (``tracer.all()``);
* ``cache``: one trace, each invoke keeping that layer's output at every step with
  ``tracer.cache(modules=[layer], device=None)`` (nnsight's recorder: no block runs
  per step; it keeps every row of the step, hidden state and residual, so it
  carries more than ``every-step``: the saved MB say how much);
* ``extract``: ``--extract-prompts`` prompts of ``--extract-len`` tokens,
  ``max_tokens=1``, every prompt token's output of 4 layers saved (the SAE
  workload); tokens/s are prompt tokens, MB/s the saved values' bytes. The plain
  rows run the same prompts' prefill (``max_tokens=1``): the floor.
* ``prefill``: the extraction prompts' plain prefill (``max_tokens=1``, nothing
  saved) on any engine: what an engine's own prefill costs, apart from extraction
  (on the plain rows it is ``extract``);
* ``shards`` (RayVLLM): the same extraction written the way the batch runner's
  ``output.format=activations`` writes it: the ranks keep every prompt token's
  rows and write token-major safetensors files of ``--shard-prompts`` prompts
  (``RemoteEngine.extract_async`` / ``extract_commit``), every prompt in flight;
  MB/s is what reached the files (under ``--shards-dir``, removed between runs).
  After each run, every process's resident memory is printed (flat = bounded).
* ``gen-shards`` (RayVLLM): ``every-step``'s job as a dataset: the ``--prompts`` prompts x
  ``--tokens`` greedy tokens, the ranks keeping the saved layer's row of every token the
  model runs (each prompt token, then each decode step's: ``extract_async(generated=True)``)
  and writing them as ``shards`` does; no block runs anywhere. Tokens/s are generated
  tokens, against plain ``generate``.

Prints one row per (engine, workload): median tokens/s, its ratio to
``vllm-defaults`` first, to ``vllm-eager``, RayVLLM's to LocalVLLM, and the
runs; then start times and one SUMMARY line. ``--json`` keeps it all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's V2 runner hung at start for plain vLLM on the GPU host; nnsight uses V1 (docs/gpu.md).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
# The child asks torch about the device before vLLM starts its engine core: fork would inherit CUDA.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

ENGINES = ("vllm-defaults", "vllm-eager", "nnsight-eager", "nnsight-taps", "local", "ray")  # + local-profile
# Graph modes (issue 23): enforce_eager=False (graphs on every step no block needs) and taps (the bench's layers).
GRAPH_ENGINES = ("local-graphs", "ray-graphs", "local-taps", "ray-taps")
# Plain vLLM, and plain vLLM with its step handed to a worker process as ours is (control rows: what the
# hand-off between engine core and worker costs without nnsight): vLLM's multiprocessing and Ray executors.
PLAIN = ("vllm-defaults", "vllm-eager", "vllm-mp", "vllm-mp-eager", "vllm-ray")
WORKLOADS = ("generate", "registered", "trace", "nonblocking", "every-step", "cache", "extract", "prefill", "shards",
             "gen-shards")


def prompts(n: int) -> list[str]:
    return [f"prompt {i}: " + "the quick brown fox jumps over the lazy dog "[: 20 + i % 20] for i in range(n)]


def extract_prompts(n: int, length: int) -> list[str]:
    words = "the quick brown fox jumps over the lazy dog and then it sleeps in the warm sun ".split()
    out = []
    for i in range(n):
        text, k = f"{i} ", i
        while len(text) < length:  # the test tokenizers take one token per character
            text += words[k % len(words)] + " "
            k += 7
        out.append(text[:length])
    return out


def params(tokens: int) -> dict:
    return dict(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)


class Check(AssertionError):
    """A workload's values did not all arrive."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise Check(what)


# -- the child: one engine, every workload it has --------------------------------------------------


def floor_of(workload: str) -> str:
    """The plain rows' workload a workload is compared with: plain generate, or for the extraction workloads
    the same prompts' prefill (a plain row's ``extract``)."""
    return "extract" if workload in ("extract", "prefill", "shards") else "generate"


class Bench:
    """One engine in this process and the workloads run on it."""

    def __init__(self, args: argparse.Namespace, engine: str) -> None:
        from nnsight_ray.models import ARCHITECTURES

        self.args, self.engine = args, engine
        spec = ARCHITECTURES[args.arch]
        self.hidden, self.layer = spec.hidden_size, spec.num_layers // 2
        self.layers = sorted({spec.num_layers // 4 * k for k in range(4)} | {spec.num_layers - 1})[-4:]
        self.texts = prompts(args.prompts)
        self.extract_texts = extract_prompts(args.extract_prompts, args.extract_len)
        self.model = None
        self.llm = None
        self.untimed: list[Callable[[], None]] = []  # a run's diagnostics, done after its clock stops

    def after_run(self) -> None:
        """The last run's diagnostics (resident memory, the ranks' gauges): outside the timed region."""
        pending, self.untimed = self.untimed, []
        for report in pending:
            report()

    # engines

    def engine_kwargs(self) -> dict:
        kwargs = dict(dtype=self.args.dtype, max_model_len=max(512, 2 * self.args.extract_len))
        if self.args.on_gpu:
            kwargs["gpu_memory_utilization"] = self.args.gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = 256 << 20
        if self.args.kernel_profile:  # vLLM's own worker profiler, started only by `kernel_profile`
            from vllm.config import ProfilerConfig

            kwargs["profiler_config"] = ProfilerConfig(
                profiler="torch", torch_profiler_dir=str(Path(self.args.kernel_profile) / self.engine),
                torch_profiler_with_stack=False)
        return kwargs

    def start(self) -> float:
        began = time.perf_counter()
        kwargs = self.engine_kwargs()
        path = self.args.model_path
        if self.engine in PLAIN:
            from vllm import LLM

            extra = {"vllm-eager": {"enforce_eager": True}, "vllm-mp": {"distributed_executor_backend": "mp"},
                     "vllm-mp-eager": {"distributed_executor_backend": "mp", "enforce_eager": True},
                     "vllm-ray": {"distributed_executor_backend": "ray"}}.get(self.engine, {})
            self.llm = LLM(path, **kwargs, **extra)
            from nnsight_ray._internal.engine.parity import config_summary

            print(f"[{self.engine}] kernels: {kernel_choices(config_summary(self.llm.llm_engine.vllm_config))}",
                  flush=True)
        elif self.engine in ("nnsight-eager", "nnsight-taps"):
            from nnsight.modeling.vllm import VLLM

            taps = ([f"model.layers.{i}.output" for i in sorted(set(self.layers) | {self.layer})]
                    if self.engine == "nnsight-taps" else None)
            self.model = VLLM(path, dispatch=True, **({"taps": taps} if taps else {}), **kwargs)
        elif self.engine.startswith("local"):
            from nnsight_ray import LocalVLLM

            self.model = LocalVLLM(path, dispatch=True, **kwargs, **self.graph_kwargs())
        elif self.engine.startswith("ray"):
            import ray

            from nnsight_ray import RayVLLM
            from nnsight_ray._internal.observe.timeline import watch_gc

            watch_gc()  # this process's long collections go into the rows' timelines ("caller gc")
            ray.init(namespace="nnsight_ray", include_dashboard=False, log_to_driver=False)
            began = time.perf_counter()  # the engine's start, not Ray's
            placement = {"cpus_per_rank": self.args.cpus_per_rank} if self.args.cpus_per_rank else {}
            self.model = RayVLLM(path, name=f"bench-{os.getpid()}", **kwargs, **self.graph_kwargs(), **placement)
            resolved = self.model.resolved_config()
            print(f"[ray] {resolved['log']}", flush=True)
            print(f"[ray] kernels: {kernel_choices(resolved['config'])}", flush=True)
        else:
            known = tuple(dict.fromkeys(ENGINES + PLAIN + GRAPH_ENGINES))
            raise SystemExit(f"unknown engine {self.engine!r}: one of {known}")
        return time.perf_counter() - began

    def graph_kwargs(self) -> dict:
        """An nnsight_ray engine's mode: eager (``local``, ``ray``), ``-graphs``, ``-taps`` (the bench's layers)."""
        if self.engine.endswith("-graphs"):
            return {"enforce_eager": False}
        if self.engine.endswith("-taps"):
            return {"taps": [f"model.layers.{i}.output" for i in sorted(set(self.layers) | {self.layer})]}
        return {}

    def step_modes(self) -> dict[str, int]:
        """How the engine's steps ran so far, on its first rank (every rank runs every step); ``{}`` for plain vLLM."""
        if self.llm is not None or not hasattr(self.model, "step_modes"):
            return {}
        return dict(self.model.step_modes()[0])

    def timeline(self, began: float, ended: float) -> str:
        """The run from ``began`` to ``ended`` (``time.monotonic``) as a timeline (``_internal/observe/timeline.py``);
        RayVLLM rows only (its actors run on this host, on this clock)."""
        if not self.engine.startswith("ray") or self.model is None:
            return ""
        try:  # a diagnostic: never fails the row (an older tree, --tree, has none)
            from nnsight_ray._internal.observe.timeline import summarize

            got = self.model.timeline(began)
        except Exception as error:
            return f"(no timeline: {type(error).__name__}: {error})"
        return summarize(began, ended, got["engine"], got["ranks"][0] if got["ranks"] else [], got.get("merges", []),
                         got.get("caller", []))

    def stop(self) -> None:
        if self.engine.startswith("ray") and self.model is not None:
            self.before_shards()
            self.model.shutdown()

    def workloads(self) -> list[str]:
        wanted = [w for w in self.args.workloads.split(",") if w]
        if self.engine in PLAIN and self.args.turns:
            # Interleaved, a plain row runs its floor beside each workload it lacks, in turn with it: the ratio
            # then compares runs taken minutes apart no more ("generate@trace": plain generate beside trace).
            wanted = [w if w in ("generate", "extract", "prefill") else f"{floor_of(w)}@{w}" for w in wanted]
            wanted = list(dict.fromkeys(wanted))
        elif self.engine in PLAIN:
            wanted = [w for w in wanted if w in ("generate", "extract", "prefill")]  # their extract is the prefill
        elif not self.engine.startswith("ray"):
            wanted = [w for w in wanted if w not in ("nonblocking", "shards", "gen-shards")]
        skipped = {pair.split(":", 1)[1] for pair in self.args.skip.split(",") if pair.startswith(self.engine + ":")}
        return [w for w in wanted if w not in skipped]

    # workloads: each returns (tokens, saved bytes) after checking what came home

    def sampling(self, tokens: int):
        from vllm import SamplingParams

        return SamplingParams(**params(tokens))

    def entrypoint(self):
        return self.llm if self.llm is not None else self.model.vllm_entrypoint

    def run_generate(self) -> tuple[int, int]:
        outputs = self.entrypoint().generate(self.texts, self.sampling(self.args.tokens), use_tqdm=False) \
            if self.llm is not None else self.entrypoint().generate(self.texts, self.sampling(self.args.tokens))
        expect(len(outputs) == len(self.texts), f"{len(outputs)} outputs for {len(self.texts)} prompts")
        expect(all(len(o.outputs[0].token_ids) == self.args.tokens for o in outputs), "short outputs")
        return len(self.texts) * self.args.tokens, 0

    def run_registered(self) -> tuple[int, int]:
        # Blocks read only locals: whatever a block's frame holds travels with it.
        model, layer, clone = self.model, self.layer, self.engine == "nnsight-taps"
        with model.edit() as (tracer, edit):
            probe = model.model.layers[layer].output[0][-1]
            if clone:  # a tapped engine's graphs rewrite their buffers next step: its docs say clone
                probe = probe.clone()
            probe = probe.save()  # named: a registered block's values travel by name
        try:
            outputs = self.entrypoint().generate(self.texts, self.sampling(self.args.tokens))
        finally:
            edit.clear()
        expect(len(outputs) == len(self.texts), "missing outputs")
        shapes = {tuple(o.saves["probe"].shape) for o in outputs if "probe" in getattr(o, "saves", {})}
        got = sum("probe" in getattr(o, "saves", {}) for o in outputs)
        expect(got == len(self.texts) and shapes == {(self.hidden,)}, f"probe on {got} outputs, shapes {shapes}")
        return len(self.texts) * self.args.tokens, got * self.hidden * 2

    def _traced(self, texts: list[str], every_step: bool, blocking: bool = True):
        import nnsight

        model, layer, clone = self.model, self.layer, self.engine == "nnsight-taps"
        extra = {} if blocking else {"blocking": False}
        with model.trace(**params(self.args.tokens), **extra) as tracer:
            for text in texts:
                with tracer.invoke(text):
                    if every_step:
                        h = nnsight.save([])
                        for _ in tracer.all():
                            value = model.model.layers[layer].output[0][-1]
                            h.append(value.clone() if clone else value)
                    else:
                        h = model.model.layers[layer].output[0][-1]
                        if clone:
                            h = h.clone()
                        h = h.save()
        # A non-blocking trace binds nothing here: its values are behind tracer.ref.
        return tracer, locals().get("h")

    def _check_rows(self, h, n: int, steps: int | None) -> int:
        rows = h if isinstance(h, list) and n > 1 else [h]
        expect(len(rows) == n, f"{len(rows)} saved values for {n} invokes")
        if steps is None:
            shapes = {tuple(r.shape) for r in rows}
            expect(shapes == {(self.hidden,)}, f"shapes {shapes}")
            return n * self.hidden * 2
        lengths = {len(r) for r in rows}
        expect(lengths == {steps}, f"{lengths} steps saved, expected {steps}")
        return n * steps * self.hidden * 2

    def run_trace(self) -> tuple[int, int]:
        _, h = self._traced(self.texts, every_step=False)
        return len(self.texts) * self.args.tokens, self._check_rows(h, len(self.texts), None)

    def run_every_step(self) -> tuple[int, int]:
        _, h = self._traced(self.texts, every_step=True)
        return len(self.texts) * self.args.tokens, self._check_rows(h, len(self.texts), self.args.tokens)

    def run_cache(self) -> tuple[int, int]:
        model, layer = self.model, self.model.model.layers[self.layer]
        with model.trace(**params(self.args.tokens)) as tracer:
            for text in self.texts:
                with tracer.invoke(text):
                    cache = tracer.cache(modules=[layer], device=None)
        views = cache if isinstance(cache, list) and len(self.texts) > 1 else [cache]
        expect(len(views) == len(self.texts), f"{len(views)} caches for {len(self.texts)} invokes")
        path = f"model.model.layers.{self.layer}"
        steps = {len(view[path]) for view in views}
        expect(steps == {self.args.tokens}, f"{steps} steps cached, expected {self.args.tokens}")
        # ``.output`` is the list of visits, or the one visit itself when there was only one (nnsight's CacheView).
        visits = [view[path].output if self.args.tokens > 1 else [view[path].output] for view in views]
        saved = sum(t.numel() * t.element_size() for outs in visits for out in outs for t in out)
        return len(self.texts) * self.args.tokens, saved

    def run_nonblocking(self) -> tuple[int, int]:
        k = self.args.traces
        chunks = [self.texts[i::k] for i in range(k)]
        tracers = [self._traced(chunk, every_step=False, blocking=False)[0] for chunk in chunks]
        saved = 0
        for chunk, tracer in zip(chunks, tracers):
            saved += self._check_rows(tracer.collect()["h"], len(chunk), None)
        return len(self.texts) * self.args.tokens, saved

    def run_prefill(self) -> tuple[int, int]:
        texts = self.extract_texts
        outputs = self.llm.generate(texts, self.sampling(1), use_tqdm=False) if self.llm is not None \
            else self.entrypoint().generate(texts, self.sampling(1))
        expect(len(outputs) == len(texts), "missing outputs")
        return sum(len(o.prompt_token_ids) for o in outputs), 0

    def run_extract(self) -> tuple[int, int]:
        texts, layers = self.extract_texts, self.layers
        if self.llm is not None:
            return self.run_prefill()
        model, clone = self.model, self.engine == "nnsight-taps"
        l0, l1, l2, l3 = layers
        with model.trace(**params(1)) as tracer:
            for text in texts:
                with tracer.invoke(text):
                    a0 = model.model.layers[l0].output[0]
                    a1 = model.model.layers[l1].output[0]
                    a2 = model.model.layers[l2].output[0]
                    a3 = model.model.layers[l3].output[0]
                    if clone:
                        a0, a1, a2, a3 = a0.clone(), a1.clone(), a2.clone(), a3.clone()
                    a0, a1, a2, a3 = a0.save(), a1.save(), a2.save(), a3.save()
        tokens, saved = 0, 0
        for name, value in (("a0", a0), ("a1", a1), ("a2", a2), ("a3", a3)):
            rows = value if len(texts) > 1 else [value]
            expect(len(rows) == len(texts), f"{name}: {len(rows)} values for {len(texts)} prompts")
            expect(all(r.dim() == 2 and r.shape[1] == self.hidden for r in rows), f"{name}: bad shapes")
            saved += sum(r.numel() * r.element_size() for r in rows)
            if name == "a0":
                tokens = sum(r.shape[0] for r in rows)
        return tokens, saved


    def before(self, workload: str) -> Any:
        """What runs before each run of ``workload``, untimed: the workload's own ``before_<workload>``,
        after emptying plain vLLM's prefix cache (``--keep-prefix-cache`` keeps it)."""
        own = getattr(self, "before_" + workload.replace("-", "_"), lambda: None)

        def before() -> None:
            # On by default in plain vLLM (nnsight engines turn it off: a cached prefix runs no hook).
            # Every run repeats the same prompts, so without this a plain row's second run reads the
            # last run's KV cache instead of computing its prefill: not the work the other rows do.
            if self.llm is not None and not self.args.keep_prefix_cache:
                expect(self.llm.reset_prefix_cache(), "the prefix cache was not emptied")
            own()

        return before

    def before_shards(self) -> None:
        import shutil

        shutil.rmtree(self.shards_dir(), ignore_errors=True)

    def shards_dir(self) -> Path:
        return Path(self.args.shards_dir or tempfile.gettempdir()) / f"bench-shards-{os.getpid()}"

    def run_shards(self) -> tuple[int, int]:
        return self._shards(self.extract_texts, [f"model.layers.{i}.output" for i in self.layers], 1)

    def before_gen_shards(self) -> None:
        self.before_shards()

    def run_gen_shards(self) -> tuple[int, int]:
        tokens = self.args.tokens
        _, saved = self._shards(self.texts, [f"model.layers.{self.layer}.output"], tokens)
        return len(self.texts) * tokens, saved

    def _shards(self, texts: list[str], locations: list[str], tokens: int) -> tuple[int, int]:
        """``texts`` extracted at ``locations`` in parts of ``--shard-prompts``; ``tokens`` > 1: every
        generated token's row too. Returns (rows written, bytes written), checked against the outputs."""
        import ray

        engine, size = self.model.vllm_entrypoint, self.args.shard_prompts
        generated = {"generated": True, "max_tokens": tokens, "ignore_eos": True} if tokens > 1 else {}
        out = str(self.shards_dir())
        pending = {}
        for start in range(0, len(texts), size):
            part = f"shard-{start // size:05d}"
            ref = engine.extract_async(texts[start:start + size], part, out, locations,
                                       indices=range(start, min(start + size, len(texts))), **generated)
            pending[ref] = part
        commits, ran = [], 0
        while pending:  # commit each part as its outputs come back, as the batch runner does
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:  # every token the model ran: the prompt, and each generated one but the last
                ran += sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in ray.get(ref))
                commits += engine.extract_commit(pending.pop(ref))
        written = [w for w in ray.get(commits) if w is not None]
        rows, saved = sum(w["rows"] for w in written), sum(w["bytes"] for w in written)
        expect(rows == ran, f"{rows} rows written for {ran} tokens run")
        expect(saved >= rows * len(locations) * self.hidden * 2, f"{saved} bytes for {rows} rows")

        def report() -> None:  # after the run's clock stops: a scan of the host's processes and an RPC
            print(f"[{self.engine}] shards: {len(written)} files, {saved / 1e6:,.0f} MB; RSS MB "
                  + ", ".join(f"{name} {mb:,.0f}" for name, mb in resident().items()), flush=True)
            try:  # a diagnostic: an older tree (--tree) has no such call
                held = engine.collective_rpc("nnsight_ray_extract_memory")
                print(f"[{self.engine}] shards: ranks hold {held}", flush=True)
            except Exception as error:  # noqa: BLE001
                print(f"[{self.engine}] shards: no extraction memory gauge ({type(error).__name__})", flush=True)

        self.untimed.append(report)
        return rows, saved


def kernel_choices(summary: dict[str, str]) -> dict[str, str]:
    """Which kernels an engine's resolved config asks for (custom ops, each IR op's priority): resolved where
    the config is built, which for RayVLLM is the engine actor, not the rank that runs them."""
    return {key.rsplit(".", 1)[-1]: value for key, value in summary.items()
            if key == "compilation_config.custom_ops" or key.startswith("kernel_config.ir_op_priority.")}


def resident() -> dict[str, float]:
    """Resident memory (MB) of every process of the engine (``engine_processes``), largest first."""
    import psutil

    found = {}
    for pid, name in engine_processes().items():
        try:
            found[f"{name.rsplit('>', 1)[-1][:24]}:{pid}"] = psutil.Process(pid).memory_info().rss / 1e6
        except psutil.Error:
            continue
    return dict(sorted(found.items(), key=lambda kv: -kv[1])[:8])


def child(args: argparse.Namespace) -> None:
    """Run one engine's workloads; write the JSON after each one (partial results survive a timeout)."""
    import torch

    args.on_gpu = torch.cuda.is_available()
    bench = Bench(args, args.child)
    result = {"engine": args.child, "workloads": {}, "errors": {}}
    out = Path(args.child_json)
    try:
        result["start_s"] = bench.start()
    except Exception as error:
        result["errors"]["start"] = f"{type(error).__name__}: {error}"
        out.write_text(json.dumps(result))
        raise
    out.write_text(json.dumps(result))
    turn = Turns(args.turns, args.turn_tag)
    for workload in bench.workloads():
        base = workload.split("@")[0]  # "generate@trace": a plain row's floor run beside trace (--interleave)
        run = getattr(bench, "run_" + base.replace("-", "_"))
        try:
            before = bench.before(base)
            with turn(workload):
                before()
                run()  # warm-up (and the first check)
                bench.after_run()
            modes_before = bench.step_modes()
            times, amounts, timelines = [], None, []
            for _ in range(args.repeats):
                with turn(workload):
                    before()
                    began, mono = time.perf_counter(), time.monotonic()
                    amounts = run()
                    times.append(time.perf_counter() - began)
                    timelines.append(bench.timeline(mono, time.monotonic()))  # untimed, between runs
                    bench.after_run()
            timeline = timelines[-1]
            slowest = max(range(len(times)), key=times.__getitem__)
            median = statistics.median(times)
            tokens, saved = amounts
            modes = {k: v - modes_before.get(k, 0) for k, v in bench.step_modes().items()}
            result["workloads"][workload] = {"seconds": times, "median_s": median, "tokens": tokens,
                                             "tokens_per_s": tokens / median, "saved_bytes": saved,
                                             "saved_mb_per_s": saved / median / 1e6,
                                             "step_modes": {k: v for k, v in modes.items() if v}}
            print(f"[{args.child}] {workload}: {tokens / median:,.0f} tok/s (runs {', '.join(f'{t:.2f}' for t in times)} s)"
                  f"{' steps ' + str(result['workloads'][workload]['step_modes']) if modes else ''}", flush=True)
            if timeline:
                result["workloads"][workload]["timeline"] = timeline
                print(f"[{args.child}] {workload} last run, ms: {timeline}", flush=True)
            if timelines[slowest] and slowest != len(times) - 1:  # the outlier's story (session 25: run 3 of 5,
                # ~0.4 s slower, in every RayVLLM row on the H200)
                result["workloads"][workload]["slowest_timeline"] = timelines[slowest]
                print(f"[{args.child}] {workload} slowest run ({slowest + 1} of {len(times)}), ms: {timelines[slowest]}",
                      flush=True)
        except Exception as error:
            result["errors"][workload] = f"{type(error).__name__}: {error}"
            print(f"[{args.child}] {workload} FAILED: {type(error).__name__}: {error}", flush=True)
        out.write_text(json.dumps(result))
    if args.profile:
        profile(bench, args.profile, args.workloads.split(","))
    if args.kernel_profile:
        kernel_profile(bench, args)
    if args.spy:
        spy(bench, args)
    bench.stop()


class Turns:
    """``--interleave``, in a child: each run (warm-up or timed) waits for the parent's go.

    Before a run the child writes ``TAG.K.ready`` (K counts its runs; the file holds the workload) and waits
    for ``TAG.K.go``; after it, and after the run's untimed timeline, ``TAG.K.done``. Without ``--turns`` a
    turn is free."""

    def __init__(self, folder: str | None, tag: str | None) -> None:
        self.folder, self.tag, self.k = (Path(folder) if folder else None), tag, 0

    @contextlib.contextmanager
    def __call__(self, workload: str) -> Iterator[None]:
        if self.folder is None:
            yield
            return
        stem = self.folder / f"{self.tag}.{self.k}"
        Path(f"{stem}.ready").write_text(workload)
        while not Path(f"{stem}.go").exists():
            time.sleep(0.005)
        try:
            yield
        finally:
            Path(f"{stem}.done").touch()
            self.k += 1


def interleave(children: list[tuple[str, list[str], dict, str | None]], folder: Path, deadline_s: float) -> dict:
    """``--interleave``: every engine's process alive at once, each run of each in turn.

    The children start one after another (each start alone, timed in the child, as without it); then, round
    after round, each live child runs its next run (a warm-up or a timed run of its next workload) while
    the others wait between runs: drift of a shared GPU over minutes hits every row alike. Returns each
    engine's exit code (``"timeout"`` past ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s
    procs, codes, runs = {}, {}, {}

    def wait_for(tag: str, suffix: str) -> bool:  # False: the child ended (or the deadline passed) first
        path = folder / f"{tag}.{runs[tag]}.{suffix}"
        while not path.exists():
            if procs[tag].poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    for tag, command, env, cwd in children:
        procs[tag], runs[tag] = subprocess.Popen(command, env=env, cwd=cwd), 0
        wait_for(tag, "ready")  # started (or failed to): the next one starts alone
    live = [tag for tag, *_ in children]
    while live:
        for tag in list(live):
            if not wait_for(tag, "ready"):
                live.remove(tag)
                continue
            (folder / f"{tag}.{runs[tag]}.go").touch()
            if not wait_for(tag, "done"):
                live.remove(tag)
                continue
            runs[tag] += 1
    for tag, proc in procs.items():
        try:
            codes[tag] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[tag] = "timeout"
    return codes


def profile(bench: Bench, top: int, workloads: list[str]) -> None:
    """Each of ``workloads`` (of generate, registered, trace, every-step, cache; default generate and trace) once under
    cProfile: the top functions by own time and by cumulative time.

    Meant for ``--engines local-profile`` (LocalVLLM with vLLM's engine core in
    this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the runner's
    work is in the profile too.
    """
    import cProfile
    import io
    import pstats

    for workload in [w for w in workloads if w in ("generate", "registered", "trace", "every-step", "cache")] or ["generate", "trace"]:
        profiler = cProfile.Profile()
        profiler.enable()
        getattr(bench, "run_" + workload.replace("-", "_"))()
        profiler.disable()
        bench.after_run()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        print(f"\nPROFILE {bench.engine} {workload} ({len(bench.texts)} prompts x {bench.args.tokens} tokens)\n"
              + out.getvalue(), flush=True)


def kernel_profile(bench: Bench, args: argparse.Namespace) -> None:
    """One run of each of ``--kernel-profile-workloads`` under vLLM's own worker profiler (torch.profiler on
    every rank: CPU and device activity); vLLM writes each worker's table, sorted by device time, and its
    trace to ``--kernel-profile``/<engine>/. The table's top rows are printed here."""
    for workload in [w for w in args.kernel_profile_workloads.split(",") if w in bench.workloads()]:
        run = getattr(bench, "run_" + workload.replace("-", "_"))
        bench.before(workload)()
        entry = bench.entrypoint()  # plain vLLM's and LocalVLLM's `LLM`, or RayVLLM's engine
        if hasattr(entry, "start_profile"):
            entry.start_profile(profile_prefix=workload)
        else:
            entry.collective_rpc("profile", args=(True, workload))
        began = time.perf_counter()
        run()
        took = time.perf_counter() - began
        bench.after_run()
        if hasattr(entry, "start_profile"):
            entry.stop_profile()
        else:
            entry.collective_rpc("profile", args=(False,))
        print(f"\nKERNELS {bench.engine} {workload}: one run under the profiler, {took:.2f} s", flush=True)
        for table in sorted((Path(args.kernel_profile) / bench.engine).glob(f"{workload}*profiler_out.txt")):
            lines = table.read_text().splitlines()
            print(f"[{table.name}]\n" + "\n".join(lines[:args.spy_top + 4] + lines[-3:]), flush=True)


def engine_processes() -> dict[int, str]:
    """Every process an engine runs in: this one, its children (vLLM's engine core), and Ray's actors
    with their children (the engine actor's engine core), by pid -> a short name."""
    import psutil

    found: dict[int, str] = {}

    def add(proc, name: str) -> None:
        found.setdefault(proc.pid, name)
        for kid in proc.children(recursive=True):
            try:
                kid_name = " ".join(kid.cmdline()[:1])[:40] or kid.name()
            except psutil.Error:
                continue
            found.setdefault(kid.pid, f"{name}>{kid_name}")

    add(psutil.Process(), "bench")
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if cmd.startswith("ray::") and "IDLE" not in cmd:
            add(proc, cmd.split()[0][5:])
    return found


def spy_summary(raw: Path, top: int) -> str:
    """A py-spy raw profile as its top frames by own samples and by inclusive samples."""
    import collections

    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        count, frames = int(count), stack.split(";")
        total += count
        names = [f.split(" (")[0] + " (" + f.rsplit("/", 1)[-1] if " (" in f else f for f in frames]
        own[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
    if not total:
        return "  (no samples)"
    lines = [f"  {total} samples; own:"] + [f"  {v / total:6.1%} {k}" for k, v in own.most_common(top)]
    lines += ["  inclusive:"] + [f"  {v / total:6.1%} {k}" for k, v in inclusive.most_common(top)]
    return "\n".join(lines)


def spy(bench: Bench, args: argparse.Namespace) -> None:
    """Each of ``--spy-workloads`` in a loop for ``--spy`` seconds, with py-spy sampling every process
    of the engine (the engine core, and on RayVLLM the engine, merge and rank actors): where each
    process spends its time, printed per process; the raw profiles go to ``--spy-dir``."""
    import shutil

    binary = shutil.which("py-spy") or args.spy_bin
    if not binary or not Path(binary).exists():
        print("[spy] no py-spy binary (pass --spy-bin)", flush=True)
        return
    out = Path(args.spy_dir or tempfile.mkdtemp(prefix="spy-"))
    out.mkdir(parents=True, exist_ok=True)
    for workload in [w for w in args.spy_workloads.split(",") if w in bench.workloads()]:
        run = getattr(bench, "run_" + workload.replace("-", "_"))
        before = bench.before(workload)
        only = [n for n in args.spy_only.split(",") if n]
        procs = {pid: name for pid, name in engine_processes().items() if not only or any(n in name for n in only)}
        spies = []
        for pid, name in procs.items():
            raw = out / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{bench.engine}-{workload}-{name}-{pid}.txt")
            spies.append((name, raw, subprocess.Popen(
                [binary, "record", "-p", str(pid), "-o", str(raw), "-f", "raw", "-r", "250",
                 "-d", str(int(args.spy)), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(1.0)  # py-spy attaches
        runs, until = [], time.perf_counter() + args.spy - 2.0
        while time.perf_counter() < until:
            before()  # as the measured runs (shards: an empty folder, not renames over the last run's files)
            began = time.perf_counter()
            run()
            runs.append(time.perf_counter() - began)
            bench.after_run()
        for _, _, proc in spies:
            proc.wait()
        print(f"\nSPY {bench.engine} {workload}: {len(runs)} runs under py-spy, "
              f"{', '.join(f'{t:.2f}' for t in runs)} s", flush=True)
        for name, raw, _ in spies:
            if raw.exists():
                print(f"[{name}] {raw.name}\n{spy_summary(raw, args.spy_top)}", flush=True)


# -- the parent: one child per engine, then the table -----------------------------------------------


def engine_tree(engine: str, trees: list[str]) -> tuple[str, str | None]:
    """``ENGINE@TAG`` -> (ENGINE, the DIR of ``--tree TAG=DIR``); a plain engine name -> (it, None)."""
    if "@" not in engine:
        return engine, None
    base, tag = engine.split("@", 1)
    found = dict(t.split("=", 1) for t in trees if "=" in t)
    if tag not in found:
        raise SystemExit(f"engine {engine}: no --tree {tag}=DIR")
    return base, str(Path(found[tag]).resolve())


def child_skip(skip: str, engine: str, base: str) -> str:
    """``--skip`` for the child of engine row ``engine`` (``ray%cache``, ``ray@old``), which runs as ``base``:
    the pairs that name that row, renamed to ``base``; a pair names one row, so ``ray:prefill`` skips
    the plain ``ray`` row only."""
    return ",".join(f"{base}:{pair.split(':', 1)[1]}" for pair in skip.split(",") if pair.startswith(engine + ":"))


def engine_env(engine: str, settings: list[str]) -> tuple[str, dict[str, str]]:
    """``ENGINE%TAG`` -> (ENGINE, the variables of every ``--env TAG=NAME=VALUE``); a plain name -> (it, {})."""
    if "%" not in engine:
        return engine, {}
    base, tag = engine.rsplit("%", 1)
    found = {}
    for setting in settings:
        mine, _, assignment = setting.partition("=")
        name, equals, value = assignment.partition("=")
        if not equals:
            raise SystemExit(f"--env {setting}: expected TAG=NAME=VALUE")
        if mine == tag:
            found[name] = value
    if not found:
        raise SystemExit(f"engine {engine}: no --env {tag}=NAME=VALUE")
    return base, found


def table(results: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    def rate(engine: str, workload: str) -> float | None:
        got = results.get(engine, {}).get("workloads", {}).get(workload)
        return got["tokens_per_s"] if got else None

    rows = []
    width = max([12] + [len(w) for result in results.values() for w in result.get("workloads", {})])
    print(f"\n{args.arch} {args.dtype}, {args.prompts} prompts x {args.tokens} tokens (all in flight), "
          f"extract {args.extract_prompts} x ~{args.extract_len} tokens, median of {args.repeats}"
          f"{', runs interleaved' if args.interleave else ''}, {args.device}")
    print(f"{'engine':<14} {'workload':<{width}} {'tok/s':>9} {'vs defaults':>11} {'vs eager':>9} {'vs local':>9} "
          f"{'MB/s':>8}  runs (s)")
    for engine, result in results.items():
        for workload, got in result.get("workloads", {}).items():
            # The plain rows' "extract" is the prefill of the same prompts; every workload's plain floor is
            # plain generate, except extraction, whose floor is that prefill.
            floor_workload = floor_of(workload.split("@")[0])
            ratios = {}
            for key, other, other_workload in (("vs_defaults", "vllm-defaults", floor_workload),
                                               ("vs_eager", "vllm-eager", floor_workload),
                                               ("vs_local", "local", workload)):
                # Interleaved, the floor's runs taken beside this workload's ("generate@trace"), if any.
                base = (rate(other, f"{other_workload}@{workload}") or rate(other, other_workload)
                        or (rate(other, "prefill") if other_workload == "extract" else None))
                if key == "vs_local":  # RayVLLM against LocalVLLM in the same mode
                    base = rate(engine.replace("ray", "local", 1), workload) if engine.startswith("ray") else None
                ratios[key] = got["tokens_per_s"] / base if base else None
            row = {"engine": engine, "workload": workload, **got, **ratios}
            rows.append(row)
            fmt = lambda v: f"{v:>8.2f}x" if v is not None else f"{'':>9}"  # noqa: E731
            print(f"{engine:<14} {workload:<{width}} {got['tokens_per_s']:>9,.0f} {fmt(ratios['vs_defaults']):>11} "
                  f"{fmt(ratios['vs_eager'])} {fmt(ratios['vs_local'])} {got['saved_mb_per_s']:>8.1f}  "
                  f"{', '.join(f'{t:.2f}' for t in got['seconds'])}"
                  f"{'  steps ' + json.dumps(got['step_modes']) if got.get('step_modes') else ''}")
        for workload, error in result.get("errors", {}).items():
            print(f"{engine:<14} {workload:<{width}} FAILED: {error}")
    for order, (engine, result) in enumerate(results.items(), start=1):
        if "start_s" in result:
            print(f"start {engine}: {result['start_s']:.1f} s (engine {order} of {len(results)})")
    print("SUMMARY " + " ".join(f"{r['engine']}/{r['workload']}={r['vs_defaults']:.3f}" for r in rows
                                if r["vs_defaults"] is not None))
    return rows


PREWARM = ("import torch, vllm, nnsight, ray, nnsight_ray\n"
           "if torch.cuda.is_available(): torch.cuda.init()")


def prewarm() -> None:
    """Import the stack once in a throwaway child, untimed: a fresh host's first engine start read every
    library from disk (session 24 on the H200: plain vLLM eager started in 95 s as an invocation's first
    engine and in 48 s as its fourth). What stays cold for the first engine: Ray's session and vLLM's on-disk caches."""
    began = time.perf_counter()
    code = subprocess.run([sys.executable, "-c", PREWARM], timeout=600).returncode
    print(f"[prewarm] imported the stack in {time.perf_counter() - began:.1f} s (exit {code}, untimed)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU build's preset: tiny Llama, float32, small sizes")
    parser.add_argument("--arch", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--engines", default=None)
    parser.add_argument("--tree", action="append", default=[], metavar="TAG=DIR",
                        help="another checkout of nnsight_ray (a worktree of an older commit): an engine named "
                             "ENGINE@TAG runs with DIR first on PYTHONPATH, beside the others in the same run")
    parser.add_argument("--env", action="append", default=[], metavar="TAG=NAME=VALUE",
                        help="an environment variable for the engines named ENGINE%%TAG (repeatable)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--traces", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extract-prompts", type=int, default=None)
    parser.add_argument("--extract-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="each engine's share (default 0.5; with --interleave 0.85 split among the engines)")
    parser.add_argument("--interleave", action="store_true",
                        help="every engine's process alive at once (started one after another), their runs in "
                             "turn: run k of every row before run k+1 of any (the rows share the GPU's drift)")
    parser.add_argument("--shard-prompts", type=int, default=64, help="shards: prompts per part file")
    parser.add_argument("--cpus-per-rank", type=float, default=0,
                        help="RayVLLM rows: CPUs each rank reserves, and its OMP threads on the CPU build "
                             "(default: RayVLLM's, 1; plain vLLM's CPU worker uses every core)")
    parser.add_argument("--keep-prefix-cache", action="store_true",
                        help="plain vLLM rows keep their prefix cache between runs (by default each run starts "
                             "with it empty: every run repeats the same prompts)")
    parser.add_argument("--skip", default="", help="ENGINE:WORKLOAD,... pairs not to run (e.g. ray:extract, "
                        "ray%%cache:prefill): each names one engine row")
    parser.add_argument("--shards-dir", default="", help="shards: where the files go (default: the temp dir)")
    parser.add_argument("--model-dir", default=None, help="reuse a checkpoint built earlier")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine's child process")
    parser.add_argument("--prewarm", action=argparse.BooleanOptionalAction, default=True,
                        help="before the first engine, an untimed child imports the stack (and initializes "
                             "CUDA), so the first engine's start is not charged for a cold page cache")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the workloads, print the top N functions of each of --workloads (generate, registered, trace, every-step) under cProfile "
                             "(engine local-profile: LocalVLLM with vLLM's engine core in process)")
    parser.add_argument("--spy", type=float, default=0, metavar="S",
                        help="after the workloads, loop each of --spy-workloads for S seconds under py-spy, "
                             "sampling every process of the engine, and print each process's top frames")
    parser.add_argument("--spy-workloads", default="generate")
    parser.add_argument("--spy-only", default="", help="spy only the processes whose names contain one of these "
                        "(comma-separated: MergeActor,EngineActor,NNsightRankProc,EngineCore,bench); all by default")
    parser.add_argument("--spy-dir", default="", help="where the raw py-spy profiles go")
    parser.add_argument("--spy-bin", default="", help="py-spy, where it is not on PATH")
    parser.add_argument("--kernel-profile", default="", metavar="DIR",
                        help="after the workloads, one run of each --kernel-profile-workloads under vLLM's worker "
                             "profiler (torch.profiler); tables and traces go to DIR/<engine>/")
    parser.add_argument("--kernel-profile-workloads", default="prefill")
    parser.add_argument("--spy-top", type=int, default=25)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--turns", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--turn-tag", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cpu = args.cpu
    defaults = dict(arch="llama" if cpu else "llama-1b", dtype="float32" if cpu else "bfloat16",
                    prompts=64 if cpu else 256, tokens=8 if cpu else 32, extract_prompts=32 if cpu else 256,
                    extract_len=64 if cpu else 128)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.child:
        return child(args)

    import torch

    from nnsight_ray.models import ensure_model

    on_gpu = torch.cuda.is_available()
    args.device = f"GPU {torch.cuda.get_device_name()}" if on_gpu else "CPU"
    engines = (args.engines.split(",") if args.engines else
               [e for e in ENGINES if on_gpu or not e.startswith("nnsight-")])
    path = str(Path(ensure_model(args.model_dir or Path(tempfile.gettempdir()) / f"bench-{args.arch}",
                                 arch=args.arch)).resolve())
    for key in ("shards_dir", "spy_dir", "spy_bin", "kernel_profile"):  # a tree's child runs in that tree
        if getattr(args, key):
            setattr(args, key, str(Path(getattr(args, key)).resolve()))
    if args.gpu_memory_utilization is None:  # interleaved engines hold the GPU together
        args.gpu_memory_utilization = round(0.85 / len(engines), 3) if args.interleave else 0.5
    results: dict[str, dict] = {}
    forwarded = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in
                 ("workloads", "prompts", "tokens", "traces", "repeats", "extract_prompts", "extract_len",
                  "shard_prompts", "shards_dir", "skip", "cpus_per_rank",
                  "gpu_memory_utilization", "profile", "spy", "spy_workloads", "spy_dir", "spy_bin",
                  "spy_top", "spy_only", "kernel_profile", "kernel_profile_workloads")] + (["--keep-prefix-cache"] if args.keep_prefix_cache else [])
    if args.prewarm:
        prewarm()
    with tempfile.TemporaryDirectory() as scratch:
        children = []
        for index, engine in enumerate(engines):
            out = Path(scratch) / f"{engine}.json"
            command = [sys.executable, str(Path(__file__).resolve()), *forwarded, "--child", engine, "--child-json", str(out),
                       "--model-path", path, "--arch", args.arch, "--dtype", args.dtype]
            plain, extra = engine_env(engine, args.env)
            env = {**os.environ, **extra}
            base, tree = engine_tree(plain, args.tree)
            command[command.index("--child") + 1] = base
            command[command.index(f"--skip={args.skip}")] = f"--skip={child_skip(args.skip, engine, base)}"
            if args.interleave:
                command += ["--turns", scratch, "--turn-tag", f"e{index}"]
            if tree:
                env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [env.get("PYTHONPATH")] if p])
            # Ray puts its driver's working directory first on every worker's sys.path, so a tree's
            # child runs in that tree: otherwise its actors would import this checkout's nnsight_ray.
            if extra:
                print(f"[{engine}] the {base} engine with {extra}", flush=True)
            if base == "local-profile":  # the engine core in the child, so the profile sees the runner
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            children.append((engine, f"e{index}", command, env, tree, out))

        def collect(engine: str, out: Path, code: Any, seconds: float) -> None:
            results[engine] = json.loads(out.read_text()) if out.exists() else {"engine": engine, "errors": {}}
            results[engine]["engine"] = engine
            if code != 0:
                results[engine].setdefault("errors", {})["process"] = f"exit {code} after {seconds:.0f} s"
            if args.json:  # partial results survive a later engine's failure
                Path(args.json).write_text(json.dumps({"results": results, "args": vars(args)}, indent=1))

        if args.interleave:
            began = time.perf_counter()
            codes = interleave([(tag, command, env, tree) for _, tag, command, env, tree, _ in children],
                               Path(scratch), args.timeout * len(children))
            for engine, tag, *_, out in children:
                collect(engine, out, codes[tag], time.perf_counter() - began)
        else:
            for engine, tag, command, env, tree, out in children:
                began = time.perf_counter()
                try:
                    code = subprocess.run(command, timeout=args.timeout, env=env, cwd=tree).returncode
                except subprocess.TimeoutExpired:
                    code = "timeout"
                collect(engine, out, code, time.perf_counter() - began)
    rows = table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "results": results, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
