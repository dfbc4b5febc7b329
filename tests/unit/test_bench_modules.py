"""The benchmarks are a package, each run as ``python -m benchmarks.<name>`` from the repository root."""
from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name != "results")


def test_every_benchmark_imports_as_a_module_and_says_how_it_runs(tmp_path):
    """Imported in a fresh process (their module-level settings stay out of this one), from another folder."""
    assert {"gpu", "attach", "batch", "payloads", "pipeline", "ray_engine", "serve", "submit", "trace_overhead",
            "nnsight_suite"} <= set(MODULES)
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    doc = importlib.import_module('benchmarks.' + name).__doc__ or ''\n"
            "    assert 'python -m benchmarks.' + name in doc and 'scripts/' not in doc, name\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", code, *MODULES], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_gpu_benchmark_runs_as_a_module(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m benchmarks.gpu"), done.stderr[-2000:]


def test_a_gpu_bench_child_runs_this_checkouts_benchmark_with_its_trees_nnsight_ray(bench_gpu, tmp_path):
    """``--tree old=DIR``: the child runs in DIR with DIR first on its path, so its ``nnsight_ray`` is DIR's,
    while the benchmark (which an older tree may not have) is this checkout's."""
    from benchmarks.gpu import cli

    (tmp_path / "nnsight_ray").mkdir()
    (tmp_path / "nnsight_ray" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = cli.child_command()
    assert command[:2] == [sys.executable, "-c"]
    done = subprocess.run(command + ["--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--engines" in done.stdout, done.stderr[-2000:]
    probe = command[2].replace("sys.exit(cli.main(sys.argv[1:]))",
                               "import benchmarks, nnsight_ray; print(benchmarks.__file__); print(nnsight_ray.__file__)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    bench_file, nnsight_ray_file = done.stdout.split()
    assert Path(bench_file) == ROOT / "benchmarks" / "__init__.py"
    assert Path(nnsight_ray_file) == tmp_path / "nnsight_ray" / "__init__.py"


def test_nnsight_suite_asks_for_an_nnsight_clone(monkeypatch, capsys):
    """No machine's path as a default: ``--nnsight-repo`` or ``NNSIGHT_REPO``."""
    from benchmarks import nnsight_suite

    monkeypatch.delenv("NNSIGHT_REPO", raising=False)
    with pytest.raises(SystemExit) as exit_:
        nnsight_suite.main([])
    assert exit_.value.code == 2 and "--nnsight-repo" in capsys.readouterr().err
    assert nnsight_suite.PLUGIN == "benchmarks.nnsight_suite"


def test_nnsight_suite_loads_as_a_pytest_plugin(tmp_path):
    """Each target's pytest process takes it as ``-p benchmarks.nnsight_suite`` (the repository on its path)."""
    (tmp_path / "test_empty.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NNSIGHT_SUITE_TARGET": "local"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "benchmarks.nnsight_suite", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-q", str(tmp_path / "test_empty.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_plain_processor_gets_as_many_batches_on_its_engine_as_the_others():
    """Ray Data LLM's max_concurrent_batches counts tasks, each running its block's batches at once (up to 4)."""
    from benchmarks.batch import plain_tasks

    assert plain_tasks(8, 32, 64) == 4  # blocks of 64, batches of 32: 4 tasks x 2 batches
    assert plain_tasks(8, 64, 64) == 8 and plain_tasks(8, 128, 64) == 8
    assert plain_tasks(8, 8, 64) == 2  # 8 batches a block, 4 at once
    assert plain_tasks(1, 32, 64) == 1


def test_cpu_split_sums_each_process_names_cpu_between_readings():
    from benchmarks.cpu_split import cpu_by_process, spent

    before = {"1": (1.0, "raylet"), "2": (2.0, "ray::IDLE"), "3": (5.0, "gone")}
    after = {"1": (1.5, "raylet"), "2": (2.25, "ray::IDLE"), "4": (0.5, "ray::IDLE"), "5": (3.0, "idle")}
    # a process born in the window counts from zero; one that ended is not seen; one that used nothing is left out
    assert spent(before, after) == [("idle", 3.0), ("ray::IDLE", 0.75), ("raylet", 0.5)]
    assert str(os.getpid()) in cpu_by_process()
