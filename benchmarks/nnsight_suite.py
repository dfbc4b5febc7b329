"""Run nnsight's own vLLM test file, unchanged, against LocalVLLM and RayVLLM layouts.

nnsight's ``tests/test_vllm.py`` (and its ``tests/conftest.py``: ``--tp``, the
``ET_prompt`` / ``MSG_prompt`` fixtures) are read at run time from a git
clone of nnsight (``--nnsight-repo`` or ``$NNSIGHT_REPO``; a bare clone will
do) at ``--rev`` into a temp dir, never copied into this project. Each target
runs in its own pytest process with this module as a plugin
(``-p benchmarks.nnsight_suite``, the repository on ``PYTHONPATH``), which, after the
test module is imported and before its fixtures are parsed, replaces two of
its globals:

* ``VLLM``: a factory building ``LocalVLLM`` or ``RayVLLM`` on a tiny seeded
  GPT-2 (``nnsight_ray.models`` arch ``gpt2-12``: 12 layers, c_fc width 3072,
  GPT-2's 50257 ids) with the CPU engine settings of ``tests/conftest.py``;
  ``tensor_parallel_size`` / ``gpu_memory_utilization`` of the suite's call are
  replaced by the target's layout; ``mode="async"`` is passed on.
* ``tp``: the module fixture (it exits when ``--tp`` exceeds the CUDA device
  count, 0 here) returns ``--tp`` as given.

Targets: ``local`` (LocalVLLM in-process), ``ray-tp1``, ``ray-tp2`` (ranks on
different raylets: STRICT_SPREAD on a 4-raylet ``ray.cluster_utils.Cluster``
on 127.0.0.1), ``ray-pp2``. Tests asserting English tokens fail everywhere on
a random model; what matters is a test that passes on ``local`` and fails on a
Ray target (the summary line counts those).

Usage (from the repository root)::

    python -m benchmarks.nnsight_suite --nnsight-repo DIR [--targets local,ray-tp1,ray-tp2,ray-pp2] [--repeat N]
        [--rev HEAD] [--test-file tests/test_vllm.py] [-k EXPR] [--timeout 1200] [--markdown out.md]

``DIR`` is any git clone of nnsight (``git clone https://github.com/ndif-team/nnsight``);
``NNSIGHT_REPO=DIR`` in the environment stands for ``--nnsight-repo DIR``.

Examples::

    # everything, once (each target holds the engine lock, nnsight-engine.lock in the temp dir, while it runs)
    python -m benchmarks.nnsight_suite --nnsight-repo path/to/nnsight
    # the lock held once for all four targets
    flock /tmp/nnsight-engine.lock timeout 3600 python -m benchmarks.nnsight_suite --nnsight-repo path/to/nnsight --no-lock
    # only the cache tests at PP=2 against the local reference
    python -m benchmarks.nnsight_suite --nnsight-repo path/to/nnsight --targets local,ray-pp2 -k TestCache
    # three runs of every target, to see flakes; table also written as markdown
    python -m benchmarks.nnsight_suite --nnsight-repo path/to/nnsight --repeat 3 --markdown suite.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

TARGETS = {
    "local": None,
    "ray-tp1": {},
    "ray-tp2": {"tensor_parallel_size": 2, "placement_strategy": "STRICT_SPREAD"},
    "ray-pp2": {"pipeline_parallel_size": 2},
}
#: ``--tp`` handed to the suite per target (its tp-dependent branches: skip below 2, tp == 1 checks).
SUITE_TP = {"local": 1, "ray-tp1": 1, "ray-tp2": 2, "ray-pp2": 1}
ENGINE_KWARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20)
DEFAULT_CKPT = os.path.join(tempfile.gettempdir(), "nnsight-suite", "gpt2-12")
#: Held by each target's pytest process: one engine-running suite at a time on a machine.
LOCK = os.path.join(tempfile.gettempdir(), "nnsight-engine.lock")
ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "benchmarks.nnsight_suite"


# ---------------------------------------------------------------------------------------------
# The pytest plugin (this module, loaded with -p benchmarks.nnsight_suite in each target's pytest process)
# ---------------------------------------------------------------------------------------------

_ENGINES: list = []
_CLUSTER: list = []


def _target() -> str:
    return os.environ["NNSIGHT_SUITE_TARGET"]


def _ensure_cluster() -> None:
    """Four raylets on 127.0.0.1, as tests/conftest.py's ``ray_cluster``."""
    if _CLUSTER:
        return
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=4, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="nnsight_ray")
    _CLUSTER.append(cluster)


def make_vllm(model_name=None, *, tensor_parallel_size=1, gpu_memory_utilization=None, dispatch=True,
              mode="sync", **kwargs):
    """What the suite's ``VLLM(...)`` builds here: the target's engine on the tiny GPT-2."""
    ckpt = os.environ["NNSIGHT_SUITE_CKPT"]
    target = _target()
    layout = TARGETS[target]
    if "distributed_executor_backend" in kwargs:  # nnsight's own Ray-executor fixtures (skipped: < 2 GPUs)
        kwargs.pop("distributed_executor_backend")
    if layout is None:
        from nnsight_ray import LocalVLLM

        model = LocalVLLM(ckpt, dispatch=dispatch, mode=mode, **ENGINE_KWARGS, **kwargs)
    else:
        from nnsight_ray import RayVLLM

        _ensure_cluster()
        name = f"suite-{target}-{len(_ENGINES)}"
        model = RayVLLM(ckpt, name=name, mode=mode, **layout, **ENGINE_KWARGS, **kwargs)
    _ENGINES.append(model)
    return model


def pytest_load_initial_conftests(early_config, parser, args) -> None:
    # Before nnsight's conftest is imported: it imports toml for a fixture the vLLM file never uses.
    if "toml" not in sys.modules:
        try:
            import toml  # noqa: F401
        except ImportError:
            import types

            stub = types.ModuleType("toml")
            stub.TomlDecodeError = ValueError
            stub.load = lambda f: {}
            sys.modules["toml"] = stub


def pytest_pycollect_makemodule(module_path, parent):
    """Import the test module ourselves, patch ``VLLM`` and ``tp``, hand pytest the patched module."""
    import pytest

    if not module_path.name.startswith("test_"):
        return None
    module = pytest.Module.from_parent(parent, path=module_path)
    mod = module.obj  # imports it; fixtures are parsed from it later, in Module.collect

    @pytest.fixture(scope="module")
    def tp(request):
        return request.config.getoption("--tp")

    mod.VLLM = make_vllm
    if hasattr(mod, "tp"):
        mod.tp = tp
    return module


def pytest_unconfigure(config) -> None:
    for model in reversed(_ENGINES):
        try:
            model.shutdown()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            print(f"nnsight_suite: shutdown of {type(model).__name__} failed: {exc!r}", file=sys.stderr)
    _ENGINES.clear()
    if _CLUSTER:
        import ray

        ray.shutdown()
        _CLUSTER.pop().shutdown()


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def fetch_suite(repo: str, rev: str, test_file: str, dest: Path) -> Path:
    """``git show`` the test file and its directory's conftest.py into ``dest``."""
    tests_dir = os.path.dirname(test_file)
    for path in (test_file, os.path.join(tests_dir, "conftest.py")):
        text = subprocess.run(["git", "-C", repo, "show", f"{rev}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        (dest / os.path.basename(path)).write_text(text)
    return dest / os.path.basename(test_file)


def run_target(target: str, test_path: Path, ckpt: str, junit: Path, timeout: int, kexpr: str | None,
               lock: bool = True) -> tuple[int, float, str]:
    env = dict(os.environ)
    env.update(NNSIGHT_SUITE_TARGET=target, NNSIGHT_SUITE_CKPT=ckpt, TOKENIZERS_PARALLELISM="false",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", NNSIGHT_RAY_ABANDON_AFTER_S="10",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = (["flock", LOCK] if lock else []) + ["timeout", "-k", "30", str(timeout), sys.executable, "-m", "pytest", str(test_path),
           "-p", PLUGIN, "-p", "no:cacheprovider", "--rootdir", str(test_path.parent),
           "-q", "-rN", "--tb=line", f"--tp={SUITE_TP[target]}", f"--junitxml={junit}"]
    if kexpr:
        cmd += ["-k", kexpr]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=test_path.parent, capture_output=True, text=True)
    return proc.returncode, time.monotonic() - start, proc.stdout[-3000:] + proc.stderr[-3000:]


def parse_junit(path: Path) -> dict[str, tuple[str, str]]:
    """``{Class::test: (pass|fail|error|skip, first line of the message)}``."""
    results: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        key = f"{cls}::{case.get('name')}"
        status, message = "pass", ""
        for tag, name in (("failure", "fail"), ("error", "error"), ("skipped", "skip")):
            node = case.find(tag)
            if node is not None:
                status = name
                message = (node.get("message") or node.text or "").strip()
                break
        first = message.splitlines()[0] if message else ""
        results[key] = (status, first[:160])
    return results


def table(results: dict[str, dict[str, tuple[str, str]]], targets: list[str]) -> tuple[str, list[str]]:
    """Markdown table plus the list of RayVLLM-only failures (``test [target]: message``)."""
    tests = sorted({t for r in results.values() for t in r}, key=lambda t: t)
    lines = ["| test | " + " | ".join(targets) + " |", "| --- |" + " --- |" * len(targets)]
    notes: dict[str, int] = {}
    ray_only = []
    for test in tests:
        cells = []
        for target in targets:
            status, msg = results.get(target, {}).get(test, ("-", ""))
            if msg and status != "pass":
                idx = notes.setdefault(msg, len(notes) + 1)
                cells.append(f"{status} [{idx}]")
            else:
                cells.append(status)
            if target != "local" and status in ("fail", "error") and results.get("local", {}).get(test, ("",))[0] == "pass":
                ray_only.append(f"{test} [{target}]: {msg}")
        lines.append(f"| {test} | " + " | ".join(cells) + " |")
    lines.append("")
    for msg, idx in notes.items():
        lines.append(f"[{idx}] `{msg.replace('`', chr(39))}`  ")
    return "\n".join(lines), ray_only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nnsight_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--nnsight-repo", default=os.environ.get("NNSIGHT_REPO"),
                        help="a git clone of nnsight (bare or not) to read its tests from; default $NNSIGHT_REPO")
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--test-file", default="tests/test_vllm.py")
    parser.add_argument("--checkpoint", default=DEFAULT_CKPT, help="built (arch gpt2-12) unless already there")
    parser.add_argument("-k", dest="kexpr", default=None, help="pytest -k expression")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per target run")
    parser.add_argument("--no-lock", action="store_true",
                        help=f"do not take {LOCK} per target (the caller holds it for the whole run)")
    parser.add_argument("--markdown", default=None, help="also write the table(s) here")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {list(TARGETS)}")
    if not args.nnsight_repo:
        parser.error("--nnsight-repo DIR (or NNSIGHT_REPO=DIR): a git clone of nnsight, whose tests are run")

    from nnsight_ray.models import ensure_model

    ckpt = str(ensure_model(args.checkpoint, arch="gpt2-12"))
    rev = subprocess.run(["git", "-C", args.nnsight_repo, "rev-parse", "--short", args.rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    out = []
    total_ray_only = 0
    with tempfile.TemporaryDirectory(prefix="nnsight-suite-") as tmp:
        test_path = fetch_suite(args.nnsight_repo, args.rev, args.test_file, Path(tmp))
        for run in range(1, args.repeat + 1):
            results: dict[str, dict] = {}
            timings = []
            for target in targets:
                junit = Path(tmp) / f"{target}-{run}.xml"
                rc, secs, tail = run_target(target, test_path, ckpt, junit, args.timeout, args.kexpr,
                                             lock=not args.no_lock)
                results[target] = parse_junit(junit)
                counts = {s: sum(1 for v in results[target].values() if v[0] == s)
                          for s in ("pass", "fail", "error", "skip")}
                timings.append(f"{target}: rc {rc}, {secs:.0f} s, {counts}")
                print(f"[run {run}] {timings[-1]}", flush=True)
                if not results[target]:
                    print(tail, flush=True)
            md, ray_only = table(results, targets)
            total_ray_only += len(ray_only)
            head = (f"nnsight {args.test_file} @ {rev}, run {run}/{args.repeat}, "
                    f"{time.strftime('%Y-%m-%d %H:%M %Z')}; " + "; ".join(timings))
            summary = f"RayVLLM-only failures (pass on local, fail/error on a Ray target): {len(ray_only)}"
            block = "\n".join([head, "", md, "", summary] + [f"  - {r}" for r in ray_only])
            print("\n" + block + "\n", flush=True)
            out.append(block)
    if args.markdown:
        Path(args.markdown).write_text("\n\n".join(out) + "\n")
    return 1 if total_ray_only else 0


if __name__ == "__main__":
    sys.exit(main())
