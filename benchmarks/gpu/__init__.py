"""Throughput of interventions beside plain vLLM, on equal footing: the honest benchmark (issue 22).

Usage::

    python -m benchmarks.gpu [--engines vllm-defaults,vllm-eager,nnsight-eager,nnsight-taps,local,ray]
        [--workloads generate,registered,trace,nonblocking,every-step,cache,extract] [--prompts 256] [--tokens 32]
        [--traces 4] [--repeats 3] [--extract-prompts 256] [--extract-len 128] [--json OUT.json]

    # a GPU machine (random 1.2B Llama, bf16), from the repository root:
    python -m benchmarks.gpu
    # the CPU build (tiny Llama, float32): checks the benchmark and gives the CPU ratios
    python -m benchmarks.gpu --cpu

Equal footing:

* **Every prompt of a workload is in flight at once** on every row: plain
  ``generate`` of all of them, one trace of ``--prompts`` invokes, or
  ``--traces`` non-blocking traces submitted together (RayVLLM; a LocalVLLM
  trace blocks, so it has no such row).
* **Each engine in its own process** (a child of this process), started once,
  shut down before the next starts; its start time is a row of its own, printed
  with its place in the order (an untimed child imports the stack first,
  ``--prewarm``, so the first engine is not charged for a cold page cache).
* **Each workload: one warm-up, then ``--repeats`` timed runs; the median** is
  printed (rows of separate runs on a shared GPU differ by up to 1.7x).
* ``--interleave``: every engine's process alive at once (started one after
  another, each start alone), and their runs taken in turn: run k of every row
  before run k+1 of any, the other engines idle between their runs, and a pause
  of ``--settle`` seconds (1.5) after each run: vLLM's shared-memory readers (a
  worker waiting for its next step, the engine core for its workers' outputs)
  spin on a core for a second after their last read, and on the 2-core machine
  that took 170-590 ms of CPU from each run of the row after it
  (``--schedstat N`` prints, per row, the host's threads that ran during its
  turns and how long each waited for a core). A shared
  GPU's drift over minutes (plain eager has measured 8.2k tok/s in one
  invocation and 16.1k in another on the same card) then hits every row alike. The engines split
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
``--tree old=path/to/old-worktree --engines vllm-defaults,ray-taps,ray-taps@old``.
One engine under other settings in the same run: ``--env hostreg=PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True``
(repeat ``--env`` for several variables of one tag) and an engine named ``ENGINE%hostreg`` runs that
engine's child with those variables set (its Ray cluster, started by the child, hands them to every
actor): ``--engines ray,ray%hostreg``. ``BENCH_CPU_BINDING`` so set gives a ``ray*`` row's RayVLLM that
``cpu_binding`` (``--env pin=BENCH_CPU_BINDING=1 --engines ray,ray%pin``: its rank on core 1 against ``auto``).

Engines: ``vllm-defaults`` (plain ``vllm.LLM`` as vLLM configures it: CUDA
graphs on a GPU), ``vllm-eager`` (plain, ``enforce_eager=True``), ``vllm-mp`` and
``vllm-ray`` (plain, defaults, but the model in a worker process of vLLM's
multiprocessing or Ray executor, as ours is; ``vllm-ray`` is GPU only), ``vllm-mp-eager``
(the same worker process, eager: the control row for the eager engines), ``vllm-async-mp-eager``
(the same, behind vLLM's ``AsyncLLM`` on an event loop in the bench's process, one request per prompt:
what RayVLLM's engine actor hosts, without Ray), ``core-async-mp-eager`` (nnsight_ray's engine logic,
``engine.core.EngineCore``, on that ``AsyncLLM`` with nnsight's settings, without Ray; vLLM's worker),
``core-async-mp-nnsight`` (the same with nnsight_ray's worker, the ranks' class, in vLLM's worker process) and
``core-async-ray-nnsight`` (that worker in a rank actor of nnsight_ray's Ray executor, the engine logic still in the
bench's process: ``ray`` without the engine actor, the caller's hop and the merge actor),
``core-actor-ray-nnsight`` (that engine inside a Ray actor, one actor call a generate: ``ray`` without its client
and merge actor), nnsight's own
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

Modules: ``workloads`` (the engines and the workloads run on them, in a child
process), ``child`` (one engine's child: its runs, timed), ``turns``
(``--interleave``'s protocol between the parent and its children),
``diagnostics`` (resident memory, cProfile, py-spy, vLLM's kernel profiler),
``schedstat`` (``--schedstat``: the host's thread times around each turn),
``cli`` (the parent: arguments, one child per engine, the table).
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's V2 runner hung at start for plain vLLM on a GPU host; nnsight uses V1 (docs/gpu.md).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
# The child asks torch about the device before vLLM starts its engine core: fork would inherit CUDA.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

from .cli import PREWARM, child_skip, engine_env, engine_tree, main, table  # noqa: E402
from .schedstat import Schedstat  # noqa: E402
from .turns import Turns, interleave  # noqa: E402
from .workloads import ENGINES, GRAPH_ENGINES, PLAIN, WORKLOADS, Bench, extract_prompts, prompts  # noqa: E402

__all__ = ["ENGINES", "GRAPH_ENGINES", "PLAIN", "PREWARM", "WORKLOADS", "Bench", "Schedstat", "Turns", "child_skip", "engine_env",
           "engine_tree", "extract_prompts", "interleave", "main", "prompts", "table"]
