"""Shared fixtures: tiny checkpoints, one Ray cluster per session, shared engines.

Engines cost ~30 s to start, so integration tests share them for the whole
session (one per layout). Every Ray process binds 127.0.0.1.
"""

from __future__ import annotations

import os

# Before `ray` is imported anywhere: keep every raylet and driver on loopback
# (docs/platform.md, "Ray on one machine").
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Results of a caller that died are dropped after this long (30 s by default);
# forwarded to the merge actors. No test leaves a live caller's result waiting.
os.environ.setdefault("NNSIGHT_RAY_ABANDON_AFTER_S", "10")
# The Serve tests run one proxy (HeadOnly: the raylets share 127.0.0.1). By
# default it prefers replicas on its own node, which would leave the other
# replica idle; on one machine "local" means nothing (inherited by the raylets).
os.environ.setdefault("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")

import nnsight_ray  # noqa: F401  (first: it defines anyio's attribute sets before nnsight loads)
import pytest
import torch

# Small enough for a dozen ranks on one 24 GiB machine; the tiny model needs ~4 KiB/token.
KV_BYTES = 64 << 20
ENGINE_KWARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
# The graph engines' taps (issue 23): every decoder layer's output, and one operation inside an attention's forward
# (its output projection, whole on every tensor-parallel rank).
SOURCE_TAP = "model.layers.0.self_attn.source.self_o_proj_0.output"
TAPS = ["model.layers.*.output", SOURCE_TAP]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny seeded Llama checkpoint (4 layers, hidden 128, 2 heads of 64)."""
    from nnsight_ray.models import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0))


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    """A tiny seeded GPT-2 checkpoint: a second module tree (transformer.h[i])."""
    from nnsight_ray.models import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny-gpt2"), arch="gpt2", seed=0))


@pytest.fixture(scope="session")
def ray_cluster():
    """Four raylets on 127.0.0.1: a 2-CPU head and three 4-CPU "nodes" (the project's ``LocalCluster``).

    CPU counts are logical (Ray's accounting): several session engines hold
    their bundles at once. The driver (pytest) joins in the ``nnsight_ray``
    namespace for the whole session. The GCS declares a lost raylet dead in
    about 3 s (``local_cluster.HEALTH_CHECK``); ``add_node``/``remove_node``
    give a test a raylet of its own to lose (test_node_loss.py).
    """
    from nnsight_ray._internal.cluster.local_cluster import LocalCluster

    cluster = LocalCluster(4, cpus_per_node=4, head_cpus=2)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def local_llama(model_dir):
    """The single-device reference: nnsight's in-process engine on the CPU build."""
    from nnsight_ray import LocalVLLM

    return LocalVLLM(model_dir, dispatch=True, **ENGINE_KWARGS)


def ray_engine(request, model_dir, name, **layout):
    """A RayVLLM deployment on the session cluster with the test engine settings."""
    from nnsight_ray import RayVLLM

    request.getfixturevalue("ray_cluster")
    model = RayVLLM(model_dir, name=name, **layout, **ENGINE_KWARGS)
    return model


@pytest.fixture(scope="session")
def session_engines(request, model_dir):
    """The session's RayVLLM deployments, started together (their starts overlap: ~1.3x one, not 2x).

    ``tp1``: one rank (built with ``enforce_eager=True``, and ``early_ranks=False``: vLLM's executor creates
    its rank); ``tp2``: TP=2 with the two ranks on two different raylets (STRICT_SPREAD), built with ``taps``
    (and ``early_ranks``, the default).
    """
    from nnsight_ray import RayVLLM

    request.getfixturevalue("ray_cluster")
    models = RayVLLM.start_many(model_dir, {
        # enforce_eager=True: a keyword nnsight's VLLM takes (and pops), once refused here (issue 14.2).
        # early_ranks=False: the one session engine whose rank vLLM's executor creates itself (every other engine
        # of the suite starts its ranks early, the default, and the executor adopts them).
        # max_save_bytes: one tenant's saves over it fail that request alone (test_tenants.py).
        "tp1": {"enforce_eager": True, "early_ranks": False, "max_save_bytes": 32 << 20},
        # taps (issue 23): a graph engine; on the CPU build every step runs eagerly and serves every location,
        # so every test on tp2 (layouts, batch, remote) also checks that untapped locations are served.
        # A tap inside a module's forward too (``.source.``), checked on the client's meta tree and opened on the ranks.
        # block_timeout_s: a remote=True tenant's runaway block is stopped after 5 s (test_remote.py).
        "tp2": {"tensor_parallel_size": 2, "placement_strategy": "STRICT_SPREAD", "taps": TAPS, "block_timeout_s": 5.0},
    }, **ENGINE_KWARGS)
    yield models
    for model in models.values():
        model.shutdown()


@pytest.fixture(scope="session")
def ray_tp1(session_engines):
    return session_engines["tp1"]


@pytest.fixture(scope="session")
def ray_tp2(session_engines):
    return session_engines["tp2"]


def request_counts(model) -> list[int]:
    """``nnsight_request_count`` on every rank of an engine (LocalVLLM or RayVLLM)."""
    return model.vllm_entrypoint.collective_rpc("nnsight_request_count")


def assert_close(actual, expected, rel: float = 1e-3) -> None:
    """Relative error of ``actual`` against ``expected`` (norm-wise) under ``rel``."""
    actual = torch.as_tensor(actual).float()
    expected = torch.as_tensor(expected).float()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-12)
    assert err < rel, f"relative error {err:.2e} >= {rel}"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a Serve proxy)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def layer_and_logits(model, prompt: str, **how):
    """One greedy token's layer-2 output and logits; ``how``: ``serve=``, ``remote=``, ... of the trace."""
    with model.trace(prompt, temperature=0.0, max_tokens=1, **how):
        hidden = model.model.layers[2].output[0].clone().save()
        logits = model.logits.clone().save()
    return hidden, logits


def multi_invoke(model, **how):
    """Two invokes, the second zeroing a layer: its layer-1 output and the other's logits."""
    with model.trace(temperature=0.0, max_tokens=2, **how) as tracer:
        with tracer.invoke("Hello"):
            a = model.model.layers[1].output[0].clone().save()
        with tracer.invoke("A longer prompt here"):
            model.model.layers[1].output[0][:] = 0
            b = model.logits.clone().save()
    return a, b


def committed_checkpoints(folder) -> list:
    """A batch run's committed Ray Data checkpoint files under ``folder/checkpoint`` (not the pending ones)."""
    from pathlib import Path

    return [p for p in (Path(folder) / "checkpoint").glob("*.parquet") if not p.name.endswith(".pending.parquet")]


def kill_after_commits(command: list[str], env: dict, log, folder, commits: int = 2, seconds: float = 600) -> int:
    """Run a batch command (output into ``folder``), SIGKILL it once ``commits`` checkpoints are committed; returns
    the prompts committed then. Bounded: the wait by ``seconds``, the kill's reaping by 60 s."""
    import signal
    import subprocess
    import time

    import pyarrow.parquet as pq

    with open(log, "wb") as handle:  # a file, not a pipe nobody drains
        first = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + seconds
        while len(committed_checkpoints(folder)) < commits:
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {commits} checkpoints committed in {seconds:.0f} s"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
    finally:
        if first.poll() is None:
            first.kill()
        first.wait(timeout=60)
    return sum(pq.read_metadata(p).num_rows for p in committed_checkpoints(folder))


def pytest_terminal_summary(terminalreporter):
    """Seconds per test module (setup, call and teardown of its tests; a shared engine's start counts where it
    first ran), so a slow run says which modules took its time, not only its slowest 25 pieces."""
    from collections import defaultdict

    seconds: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                seconds[report.nodeid.split("::")[0]] += report.duration
    if not seconds:
        return
    terminalreporter.write_sep("=", f"seconds per module ({sum(seconds.values()):.0f} s in tests; modules over 5 s)")
    for module, total in sorted(seconds.items(), key=lambda item: -item[1]):
        if total >= 5:
            terminalreporter.write_line(f"{total:8.1f}s  {module}")
