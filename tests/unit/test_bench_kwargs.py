"""The GPU benchmark's engine arguments: every engine of one invocation gets the same ones (equal footing)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest



@pytest.mark.parametrize("on_gpu", [True, False])
@pytest.mark.parametrize("kernel_profile", ["", "/tmp/kp"])
def test_the_kv_cache_is_sized_by_platform_whether_or_not_a_kernel_profile_is_asked(bench_gpu, on_gpu, kernel_profile):
    """A GPU engine sizes its KV cache by ``gpu_memory_utilization``, a CPU engine gets 256 MiB; asking for a
    kernel profile only adds vLLM's profiler config (two GPU benches once ran with a 256 MiB cache because the
    profiler's branch had taken the CPU's ``else``)."""
    args = SimpleNamespace(dtype="bfloat16", extract_len=256, on_gpu=on_gpu, gpu_memory_utilization=0.5,
                           kernel_profile=kernel_profile)
    kwargs = bench_gpu.Bench.engine_kwargs(SimpleNamespace(args=args, engine="ray"))
    assert ("gpu_memory_utilization" in kwargs) is on_gpu
    assert ("kv_cache_memory_bytes" in kwargs) is (not on_gpu)
    assert ("profiler_config" in kwargs) is bool(kernel_profile)
    if kernel_profile:
        assert kwargs["profiler_config"].torch_profiler_dir == "/tmp/kp/ray"


def test_an_engine_at_a_tag_runs_from_that_tree(bench_gpu, tmp_path):
    """``--tree old=DIR --engines ray-taps,ray-taps@old``: the same engine from two checkouts in one run."""
    assert bench_gpu.engine_tree("ray-taps", []) == ("ray-taps", None)
    assert bench_gpu.engine_tree("ray-taps@old", [f"old={tmp_path}"]) == ("ray-taps", str(tmp_path.resolve()))
    with pytest.raises(SystemExit, match="no --tree new=DIR"):
        bench_gpu.engine_tree("ray@new", [f"old={tmp_path}"])


def test_an_engine_with_a_percent_tag_runs_with_that_tags_variables(bench_gpu):
    settings = ["reg=PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
                "reg=NNSIGHT_RAY_EXTRACT_WRITERS=8", "other=X=1"]
    assert bench_gpu.engine_env("ray", settings) == ("ray", {})
    assert bench_gpu.engine_env("ray%reg", settings) == ("ray", {
        "PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
        "NNSIGHT_RAY_EXTRACT_WRITERS": "8"})
    assert bench_gpu.engine_env("ray-taps@old%other", settings) == ("ray-taps@old", {"X": "1"})
    with pytest.raises(SystemExit):
        bench_gpu.engine_env("ray%none", settings)
    with pytest.raises(SystemExit):
        bench_gpu.engine_env("ray%bad", ["bad=NOVALUE"])


def test_a_skip_pair_names_one_engine_row(bench_gpu):
    """``--skip ray%cache:prefill`` skips that row's prefill only; its child runs as ``ray``."""
    skip = "ray%cache:prefill,ray:extract,ray-taps@old:trace"
    assert bench_gpu.child_skip(skip, "ray%cache", "ray") == "ray:prefill"
    assert bench_gpu.child_skip(skip, "ray", "ray") == "ray:extract"
    assert bench_gpu.child_skip(skip, "ray-taps@old", "ray-taps") == "ray-taps:trace"
    assert bench_gpu.child_skip("", "ray", "ray") == ""


def test_the_prewarm_child_imports_only_installed_modules(bench_gpu):
    """``--prewarm`` (the default) runs ``PREWARM`` in an untimed child before the first engine: valid code
    that imports the stack this environment has (a name that is not installed would fail every bench)."""
    import ast
    import importlib.util

    tree = ast.parse(bench_gpu.PREWARM)
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert names == {"torch", "vllm", "nnsight", "ray", "nnsight_ray"}
    assert all(importlib.util.find_spec(name) is not None for name in names)
