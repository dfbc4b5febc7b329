"""The project's benchmarks: each module runs as ``python -m benchmarks.<name>`` from the repository root.

Each measures against a baseline in the same run (plain vLLM, LocalVLLM, one
stage, ...), so its ratios hold on any machine; records of past runs are kept
under ``benchmarks/results/``.

- ``gpu``: throughput of interventions beside plain vLLM, on equal footing (any
  GPU; ``--cpu`` on the CPU build), graph modes, activation datasets;
- ``attach``: the caller's cost of one trace of N invokes;
- ``batch``: prompts/s of the batch runner against plain LocalVLLM loops;
- ``payloads``: rank -> merge actor, in-band bytes against out-of-band buffers;
- ``pipeline``: what tracing across pipeline stages costs, beside one stage;
- ``ray_engine``: the Ray rank executor and RayVLLM, each a ratio;
- ``serve``: requests/s of the Ray Serve deployment against ``nnsight-serve``;
- ``submit``: how soon a long call's first request reaches vLLM;
- ``trace_overhead``: an nnsight trace against a plain vLLM generate;
- ``nnsight_suite``: nnsight's own vLLM test file against LocalVLLM and RayVLLM
  layouts (also a pytest plugin, ``-p benchmarks.nnsight_suite``).

Nothing here is imported by the package ``nnsight_ray``; importing this package
imports nothing else.
"""

#: Seconds between one measured turn and the next when two engines take turns on one host: vLLM's shared-memory
#: readers (a worker waiting for its next step, the engine core for its workers' outputs) spin on a core for one
#: second after their last read (``SpinCondition``, vLLM 0.32), so without a pause each turn shares the cores with
#: the engine that ran before it (170-590 ms of CPU in each ~0.8 s turn on the 2-core machine).
SETTLE_S = 1.5
