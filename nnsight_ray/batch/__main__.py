"""``python -m nnsight_ray.batch``: run a batch config on a Ray cluster.

Usage::

    python -m nnsight_ray.batch --config run.yaml [--set key.sub=value ...]
                                [--address HOST:PORT | --local-cluster N]
                                [--connect NAME ...] [--check]

Examples::

    # inside a Ray job (RAY_ADDRESS is set by Ray):
    ray job submit --address http://127.0.0.1:8265 --working-dir . \\
        -- python -m nnsight_ray.batch --config cluster_configs/batch-demo.yaml
    # on this machine, on an embedded cluster of three raylets:
    python -m nnsight_ray.batch --config cluster_configs/batch-demo.yaml --local-cluster 3
    # check a config and its inputs without starting any engine:
    python -m nnsight_ray.batch --config run.yaml --check
    # two engines instead of one, another output folder:
    python -m nnsight_ray.batch --config run.yaml --set engine.replicas=2 --set output.dir=runs/r2

Runs take a Ray Data pipeline (``pipeline``, over ``nnsight_ray.data``, any
TP x PP): values per prompt and activation datasets alike, on engines of the
run's own or, with ``--connect``, on running deployments (left running).
Rerunning the same command resumes:
what was written is kept, the rest runs. Exit status: 0 done, 1 unfinished
(rerun to resume), 2 bad config or inputs (nothing started).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

__all__ = ["add_arguments", "main", "run_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, help="batch run YAML (schema: nnsight_ray.batch.config)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set engine.replicas=2 --set saves.0.tokens=all")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--address", help="GCS address of the Ray cluster to join (host:port); "
                       "default: RAY_ADDRESS (set inside Ray jobs)")
    where.add_argument("--local-cluster", type=int, metavar="N",
                       help="start an embedded cluster of N raylets on 127.0.0.1 for this run (demo, tests)")
    parser.add_argument("--cpus-per-node", type=int, default=2,
                        help="logical CPUs of each --local-cluster raylet (default 2)")
    parser.add_argument("--connect", action="append", default=[], metavar="NAME",
                        help="run on this running RayVLLM deployment instead of starting engines (repeat for "
                        "several; the engine section is not used; the deployments keep running)")
    parser.add_argument("--check", action="store_true",
                        help="check the config and every input (prompts, intervention, save locations), then exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging of nnsight_ray")
    return parser


def _logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("nnsight_ray")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def run_from_args(args: argparse.Namespace) -> int:
    if args.local_cluster:
        # Before anything imports Ray (batch.pipeline imports Ray Data, the preflight vLLM): the embedded cluster
        # and this driver stay on 127.0.0.1 (else the driver looks for its raylet at the machine's external address).
        from .._internal.cluster.local_cluster import loopback_only

        loopback_only()
    from .config import load_config
    from .errors import BatchConfigError, BatchRunError
    from .pipeline import ACTIVATIONS_DIR, refuse_runner_folder
    from .sources import check_source

    _logging(args.verbose)
    try:
        # Everything about the inputs (module paths against the meta tree,
        # engine arguments, prompts, the output folder) is checked before Ray
        # is touched, so a typo costs seconds, not a cluster start.
        from .preflight import prepare

        config = load_config(args.config, args.overrides)
        prepared = prepare(config, args.config)
        refuse_runner_folder(prepared)
        if args.check:
            count = len(prepared.prompts)
            if config.prompts.remote:  # read through Ray Data: joins the cluster (no engine starts)
                from .._internal.cluster.placement import connect_ray

                connect_ray(args.address)
                count = check_source(config.prompts)
            where = "Ray Data (nnsight_ray.data)"
            if args.connect:
                where += f" with the running engine(s) {args.connect}"
            if config.activations:
                where += f"; the engines' ranks write the activation files into {prepared.run_dir.path / ACTIVATIONS_DIR}"
            print(f"config OK: {count} prompts -> {prepared.run_dir.path}, on {where}"
                  + (f"; saves read in order {[r.name for r in prepared.reads]}" if prepared.reads else ""))
            return 0
    except BatchConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    cluster = None
    try:
        if args.local_cluster:
            from .._internal.cluster.local_cluster import LocalCluster

            cluster = LocalCluster(args.local_cluster, args.cpus_per_node)
        from .._internal.cluster.placement import connect_ray

        connect_ray(args.address)
        from .pipeline import run_on_ray_data

        result = run_on_ray_data(prepared, connect=args.connect)
        print(result.summary(), flush=True)
        return 0 if result.complete else 1
    except BatchConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except BatchRunError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if cluster is not None:
            cluster.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnsight_ray.batch",
                                     description="Run a batch of nnsight traces on a Ray cluster; "
                                     "a Ray Data pipeline, rows to Parquet, resumable.")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
