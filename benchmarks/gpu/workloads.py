"""The engines and the workloads timed on them: one ``Bench`` per engine, in its own child process.

Each ``run_<workload>`` runs one workload and checks what came home before it
counts; it returns ``(tokens, saved bytes)``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .diagnostics import kernel_choices, resident

ENGINES = ("vllm-defaults", "vllm-eager", "nnsight-eager", "nnsight-taps", "local", "ray")  # + local-profile
# Graph modes (issue 23): enforce_eager=False (graphs on every step no block needs) and taps (the bench's layers).
GRAPH_ENGINES = ("local-graphs", "ray-graphs", "local-taps", "ray-taps")
# Plain vLLM, and plain vLLM with its step handed to a worker process as ours is (control rows: what the
# hand-off between engine core and worker costs without nnsight): vLLM's multiprocessing and Ray executors.
# vllm-async-mp-eager: vLLM's AsyncLLM (what RayVLLM's engine actor hosts) in this process, without Ray.
# core-async-mp-eager: nnsight_ray's engine logic (``engine.core.EngineCore``) on that AsyncLLM, without Ray.
# core-async-mp-nnsight: the same with nnsight_ray's worker (the rank's worker class, nnsight's model runner) in
# vLLM's worker process; core-async-ray-nnsight: the same worker in a rank actor of nnsight_ray's Ray executor (what
# RayVLLM's engine core runs), the engine logic still in this process. Between them and ``ray``, one part at a time:
# the worker, the rank as a Ray actor, the engine logic in a Ray actor with the caller's and the merge's hops.
# core-actor-ray-nnsight: core-async-ray-nnsight's engine inside a Ray actor, one actor call a generate (no merge).
PLAIN = ("vllm-defaults", "vllm-eager", "vllm-mp", "vllm-mp-eager", "vllm-ray", "vllm-async-mp-eager",
         "core-async-mp-eager", "core-async-mp-nnsight", "core-async-ray-nnsight", "core-actor-ray-nnsight")
WORKLOADS = ("generate", "registered", "trace", "nonblocking", "every-step", "cache", "extract", "prefill", "shards",
             "gen-shards")


# The engine-logic rows whose ranks run nnsight_ray's worker (they answer the ranks' timeline RPC).
NNSIGHT_WORKER_ROWS = ("core-async-mp-nnsight", "core-async-ray-nnsight", "core-actor-ray-nnsight")
# nnsight's engine settings, as RayVLLM runs them (the engine-logic rows).
NNSIGHT_SETTINGS = dict(enforce_eager=True, disable_log_stats=True, enable_prefix_caching=False,
                        enable_chunked_prefill=False)


def local_ray() -> None:
    """This process's own Ray instance, listening on 127.0.0.1 only (a ``ray*`` or Ray-rank row, ``cpu_split``)."""
    from nnsight_ray._internal.cluster.local_cluster import loopback_only

    loopback_only()
    import ray

    ray.init(address="local", namespace="nnsight_ray", include_dashboard=False, log_to_driver=False)


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


def floor_of(workload: str) -> str:
    """The plain rows' workload a workload is compared with: plain generate, or for the extraction workloads
    the same prompts' prefill (a plain row's ``extract``)."""
    return "extract" if workload in ("extract", "prefill", "shards") else "generate"


class AsyncEntrypoint:
    """vLLM's ``AsyncLLM`` behind ``vllm.LLM``'s ``generate``: a control row for RayVLLM's engine actor.

    The engine actor hosts an ``AsyncLLM`` on its event loop and starts one request
    per prompt, its scheduler paused while a call's requests are added; here the same
    engine does the same on an event loop in a thread of the bench's process, with no
    Ray in between (``generate`` waits as a caller of the actor does).
    """

    def __init__(self, path: str, **kwargs: Any) -> None:
        import asyncio
        import threading

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="async-llm").start()

        async def start():
            from vllm.usage.usage_lib import UsageContext

            # vllm.LLM's usage context: its batch-size defaults (on the CPU 256 sequences and 4,096 tokens a
            # step, against 128 and 2,048 for an engine context), so only the client differs from vllm-mp-eager.
            return AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, **kwargs), usage_context=UsageContext.LLM_CLASS)

        self.engine = self.call(start())
        self.llm_engine = self.engine  # config_summary reads .llm_engine.vllm_config
        self.count = 0

    def call(self, coroutine: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def generate(self, texts: list[str], sampling: Any, use_tqdm: bool = False) -> list:
        import asyncio

        from vllm.sampling_params import RequestOutputKind

        sampling = sampling.clone()
        sampling.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate and the engine actor ask

        async def one(text: str, request_id: str):
            final = None
            async for output in self.engine.generate(text, sampling, request_id):
                final = output
            return final

        async def every(base: int):
            # As the engine actor does (``_hold``): the scheduler paused while the call's requests are added,
            # so they start in one step rather than in waves over several part-full steps.
            core = self.engine.engine_core
            await core.pause_scheduler_async(mode="keep", clear_cache=False)
            tasks = [asyncio.ensure_future(one(t, str(base + i))) for i, t in enumerate(texts)]
            added = self.engine.output_processor.external_req_ids
            for _ in range(64):
                if all(str(base + i) in added for i in range(len(texts))):
                    break
                await asyncio.sleep(0)
            await core.resume_scheduler_async()
            return await asyncio.gather(*tasks)

        base, self.count = self.count, self.count + len(texts)
        return self.call(every(base))

    def reset_prefix_cache(self) -> bool:
        return self.call(self.engine.reset_prefix_cache()) is not False


class CoreEntrypoint(AsyncEntrypoint):
    """nnsight_ray's engine logic (``engine.core.EngineCore``: prompts rendered in batches, the scheduler held
    while a call's requests are added, one task a request, the hand-off) on the same ``AsyncLLM``, without
    Ray: against ``vllm-async-mp-eager`` it prices the engine logic, against ``ray`` what Ray adds."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        import asyncio

        from nnsight_ray._internal.engine.core import EngineCore

        self.waiting: dict[str, tuple[list, Any, int]] = {}

        def notify(batch: list) -> None:  # the merge actors' part: a call's reports, in order, once all ended
            for report in batch:
                reports, done, size = self.waiting[report.group]
                reports.append(report)
                if len(reports) == size:
                    done.set()

        async def make():
            return EngineCore(self.engine, notify, lambda: asyncio.sleep(0, "dead"), on_dead=print)

        self.core = self.call(make())

    def generate(self, texts: list[str], sampling: Any, use_tqdm: bool = False) -> list:
        import asyncio

        async def every(group: str):
            done = asyncio.Event()
            self.waiting[group] = ([], done, len(texts))
            self.core.submit(group, texts, [sampling] * len(texts))  # submit sets FINAL_ONLY on it, as on the actor's copy
            await done.wait()
            reports = sorted(self.waiting.pop(group)[0], key=lambda report: report.index)
            errors = [report.error for report in reports if report.error is not None]
            if errors:
                raise errors[0]
            return [report.output for report in reports]

        self.count += 1
        return self.call(every(f"call{self.count}"))

    def timeline(self, since: float) -> dict:
        """The engine logic's events and its ranks' steps from ``since`` on, as ``RayVLLM.timeline`` gives them
        (the ranks answer only with nnsight_ray's worker)."""
        ranks = self.call(self.engine.collective_rpc("nnsight_ray_step_timeline", args=(since,)))
        return {"engine": self.core.timeline.since(since), "ranks": ranks}


class CoreHost:
    """A ``CoreEntrypoint`` as a Ray actor's state (``ActorEntrypoint``)."""

    def __init__(self, path: str, kwargs: dict) -> None:
        self.core = CoreEntrypoint(path, **kwargs)

    def limits(self) -> dict:
        scheduler = self.core.llm_engine.vllm_config.scheduler_config
        return {"max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens}

    def generate(self, texts: list[str], sampling: Any) -> list:
        return self.core.generate(texts, sampling)

    def timeline(self, since: float) -> dict:
        return self.core.timeline(since)

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()


class ActorEntrypoint:
    """``CoreEntrypoint`` inside a Ray actor, one actor call a generate (its outputs come back as the call's result,
    with no merge actor): between ``core-async-ray-nnsight`` and ``ray``, the price of the engine logic living in a
    Ray worker process behind an actor call."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        from types import SimpleNamespace

        import ray

        root = str(Path(__file__).resolve().parents[2])  # the worker imports this module as the bench does
        host = ray.remote(num_cpus=0, runtime_env={"env_vars": {"PYTHONPATH": root}})(CoreHost)
        self.actor = host.remote(path, kwargs)
        limits = ray.get(self.actor.limits.remote())
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(**limits)))

    def generate(self, texts: list[str], sampling: Any, use_tqdm: bool = False) -> list:
        import ray

        return ray.get(self.actor.generate.remote(texts, sampling))

    def timeline(self, since: float) -> dict:
        import ray

        return ray.get(self.actor.timeline.remote(since))

    def reset_prefix_cache(self) -> bool:
        import ray

        return ray.get(self.actor.reset_prefix_cache.remote())


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
        if self.engine == "vllm-async-mp-eager":
            self.llm = AsyncEntrypoint(path, distributed_executor_backend="mp", enforce_eager=True,
                                       disable_log_stats=True, **kwargs)  # vllm.LLM's default, as ours
        elif self.engine == "core-async-mp-eager":
            self.llm = CoreEntrypoint(path, distributed_executor_backend="mp", **NNSIGHT_SETTINGS, **kwargs)
        elif self.engine in NNSIGHT_WORKER_ROWS:
            from nnsight_ray._internal.engine import platform

            for key, value in platform.engine_env().items():  # what RayVLLM's engine processes get
                os.environ.setdefault(key, value)
            from nnsight_ray._internal.ranks.limits import engine_limits

            # the engine's limits as RayVLLM passes them (the ranks' watchdog reads them)
            extra = engine_limits({"worker_cls": platform.worker_cls(), "distributed_executor_backend": "mp"})
            if self.engine != "core-async-mp-nnsight":
                from nnsight_ray._internal.ranks.executor import configure_engine_kwargs

                local_ray()
                extra = configure_engine_kwargs({**extra, "distributed_executor_backend": "ray"})
            entrypoint = ActorEntrypoint if self.engine == "core-actor-ray-nnsight" else CoreEntrypoint
            self.llm = entrypoint(path, **NNSIGHT_SETTINGS, **extra, **kwargs)
        elif self.engine in PLAIN:
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
            from nnsight_ray import RayVLLM
            from nnsight_ray._internal.observe.timeline import watch_gc

            watch_gc()  # this process's long collections go into the rows' timelines ("caller gc")
            local_ray()
            began = time.perf_counter()  # the engine's start, not Ray's
            placement = {"cpus_per_rank": self.args.cpus_per_rank} if self.args.cpus_per_rank else {}
            if os.environ.get("BENCH_CPU_BINDING"):
                placement["cpu_binding"] = os.environ["BENCH_CPU_BINDING"]
            self.model = RayVLLM(path, name=f"bench-{os.getpid()}", **kwargs, **self.graph_kwargs(), **placement)
            resolved = self.model.resolved_config()
            print(f"[ray] {resolved['log']}", flush=True)
            print(f"[ray] kernels: {kernel_choices(resolved['config'])}", flush=True)
        else:
            known = tuple(dict.fromkeys(ENGINES + PLAIN + GRAPH_ENGINES))
            raise SystemExit(f"unknown engine {self.engine!r}: one of {known}")
        if self.llm is not None:  # the batch limits a plain row runs with (RayVLLM's print their own)
            scheduler = self.llm.llm_engine.vllm_config.scheduler_config
            print(f"[{self.engine}] max_num_seqs={scheduler.max_num_seqs}, "
                  f"max_num_batched_tokens={scheduler.max_num_batched_tokens}", flush=True)
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
        RayVLLM rows and the engine-logic rows with nnsight_ray's worker (their processes run on this host, on this
        clock)."""
        nnsight_worker = self.engine in NNSIGHT_WORKER_ROWS
        if not (self.engine.startswith("ray") and self.model is not None) and not nnsight_worker:
            return ""
        try:  # a diagnostic: never fails the row (an older tree, --tree, has none)
            from nnsight_ray._internal.observe.timeline import summarize

            got = self.llm.timeline(began) if nnsight_worker else self.model.timeline(began)
        except Exception as error:
            return f"(no timeline: {type(error).__name__}: {error})"
        return summarize(began, ended, got["engine"], got["ranks"][0] if got["ranks"] else [], got.get("merges", []),
                         got.get("caller", []))

    def stop(self) -> None:
        if self.engine.startswith("ray") and self.model is not None:
            self.before_shards()
            self.model.shutdown()
        if isinstance(self.llm, AsyncEntrypoint):
            self.llm.engine.shutdown()

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

