"""The GPU suite: the product on a real accelerator, checked against transformers.

Runs where CUDA is available (the GPU host, ``docs/gpu.md``); skipped
everywhere else, so CPU CI collects it and skips it cleanly. To debug the
suite's own logic on a CPU machine, ``NNSIGHT_RAY_GPU_SUITE_ON_CPU=1`` runs it
on vLLM's CPU build in float32 (tolerance 1e-3 instead of 2e-2).

One Ray head (``ray start --head`` on 127.0.0.1, GPUs visible) serves every
test of the session, so ``ray job submit`` reaches the same cluster the
engines run on; it is stopped (only its own processes) at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from ray_head import free_ports, stop_processes

ON_GPU = torch.cuda.is_available()
ON_CPU_DEBUG = os.environ.get("NNSIGHT_RAY_GPU_SUITE_ON_CPU") == "1"
ENABLED = ON_GPU or ON_CPU_DEBUG

#: fp16/bf16 against transformers' fp32 forward (the issue's 2e-2), fp32 on the CPU build.
DTYPE = "bfloat16" if ON_GPU else "float32"
TOL = 2e-2 if ON_GPU else 1e-3
#: Several engines share one GPU in this suite: each takes a small, fixed share.
ENGINE_KWARGS = (dict(dtype=DTYPE, max_model_len=256, gpu_memory_utilization=0.12,
                      kv_cache_memory_bytes=1 << 30) if ON_GPU
                 else dict(dtype=DTYPE, max_model_len=256, kv_cache_memory_bytes=64 << 20))
KEY = "gpu-suite-key"


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="GPU suite: no CUDA here (NNSIGHT_RAY_GPU_SUITE_ON_CPU=1 runs it on the CPU build)")
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
            if not ENABLED:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory):
    from nnsight_ray.models import build_model

    return str(build_model(tmp_path_factory.mktemp("gpu-tiny-llama"), arch="llama", seed=0))


@pytest.fixture(scope="session")
def head():
    """``ray start --head`` on 127.0.0.1 with its own ports and temp dir; this process joins it."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="nrgpu", dir="/tmp")
    gcs, dashboard, client = free_ports(3)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--node-ip-address=127.0.0.1",
               f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
               "--include-dashboard=true", f"--ray-client-server-port={client}", f"--temp-dir={temp_dir}",
               "--disable-usage-stats", f"--num-cpus={8 if ON_GPU else 4}"]
    needles = [temp_dir, f"127.0.0.1:{gcs}"]
    started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        ray.init(address=f"127.0.0.1:{gcs}", namespace="nnsight_ray")
        yield {"dashboard": f"http://127.0.0.1:{dashboard}", "address": f"127.0.0.1:{gcs}", "env": env}
    finally:
        ray.shutdown()
        stop_processes(needles)
        subprocess.run(["rm", "-rf", temp_dir], check=False)


# Module scope: one GPU is lent, so each engine gives it back before the
# entry-point tests (a Serve replica, a batch job) start engines of their own.
@pytest.fixture(scope="module")
def local(gpu_model_dir):
    """nnsight's in-process engine through ``LocalVLLM`` (started before Ray's so they overlap less)."""
    from nnsight_ray import LocalVLLM

    began = time.monotonic()
    model = LocalVLLM(gpu_model_dir, dispatch=True, **ENGINE_KWARGS)
    print(f"\n[gpu-suite] LocalVLLM start {time.monotonic() - began:.1f} s")
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def rayvllm(head, gpu_model_dir):
    """RayVLLM, TP=1: its rank actor in a GPU bundle of the head's placement group."""
    from nnsight_ray import RayVLLM

    began = time.monotonic()
    model = RayVLLM(gpu_model_dir, name="gpu-tp1", **ENGINE_KWARGS)
    print(f"\n[gpu-suite] RayVLLM start {time.monotonic() - began:.1f} s")
    yield model
    model.shutdown()


class HF:
    """transformers' fp32 forward on the same checkpoint, with hooks where the suite reads."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.layers = self.model.model.layers

    def run(self, prompt: str, edit=None) -> dict:
        """Every layer's residual stream, every MLP's input and output, the last logits.

        ``edit(layer_index, mlp_output, record) -> new mlp_output or None`` changes the forward.
        """
        return self.run_ids(self.tokenizer.encode(prompt), edit)

    @torch.no_grad()
    def run_ids(self, token_ids: list, edit=None) -> dict:
        """``run`` on token ids (a prompt and the tokens an engine generated after it): every row is a position."""
        record: dict = {"layers": [], "mlp_in": [], "mlp_out": [], "attn_out": []}
        hooks = []
        for i, layer in enumerate(self.layers):
            # the attention's output: its o_proj's (vLLM's ``self_attn.source.self_o_proj_0.output[0]``)
            hooks.append(layer.self_attn.register_forward_hook(
                lambda _m, _i, out: record["attn_out"].append(out[0][0].clone())))
            hooks.append(layer.register_forward_hook(
                lambda _m, _i, out: record["layers"].append((out[0] if isinstance(out, tuple) else out)[0].clone())))
            hooks.append(layer.mlp.register_forward_pre_hook(
                lambda _m, args: record["mlp_in"].append(args[0][0].clone())))

            def mlp_hook(_m, _args, out, i=i):
                new = edit(i, out[0], record) if edit is not None else None
                record["mlp_out"].append((out[0] if new is None else new).clone())
                return None if new is None else new[None]

            hooks.append(layer.mlp.register_forward_hook(mlp_hook))
        try:
            ids = torch.tensor([list(token_ids)])
            record["logits"] = self.model(ids).logits[0, -1].clone()
        finally:
            for hook in hooks:
                hook.remove()
        return record


@pytest.fixture(scope="session")
def hf(gpu_model_dir):
    return HF(gpu_model_dir)


def rel_err(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual).detach().float().cpu(), torch.as_tensor(expected).detach().float().cpu()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def assert_close(actual, expected, tol: float = TOL, what: str = "") -> None:
    err = rel_err(actual, expected)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"
