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
