"""``nnsight-ray submit``: a batch YAML submitted to a Ray cluster as a Ray job, its log followed to the end.

The job runs ``python -m nnsight_ray.batch --config <config> [--set ...]`` on
the cluster (Ray's ``JobSubmissionClient``: the same as ``ray job submit``).
The config is validated here first, so a typo fails in a second on your
machine instead of minutes into a job. Exit status: 0 when the job succeeded,
1 when it failed or stopped (the run resumes from its checkpoint when resubmitted),
2 for a bad config.

Usage::

    nnsight-ray submit --config RUN.yaml [--address http://HOST:8265]
        [--set key.sub=value ...] [--working-dir DIR | --no-working-dir]
        [--entrypoint-num-cpus N] [--env KEY=VALUE ...] [--python PYTHON]
        [--submission-id ID] [--no-wait]

(``python -m nnsight_ray.cli submit ...`` is the same command.)

Examples::

    # the local three-node simulation (cluster_configs/local-multinode.sh), from the repository root:
    nnsight-ray submit --config cluster_configs/batch-demo.yaml \\
        --set output.dir=$PWD/runs/batch-demo --env VLLM_CPU_KVCACHE_SPACE=1
    # a real cluster: paths on shared storage, driver on a GPU worker
    nnsight-ray submit --address http://head:8265 --config run.yaml --entrypoint-num-cpus 1
    # a config already on the cluster's filesystem, nothing uploaded
    nnsight-ray submit --no-working-dir --config /mnt/shared/run.yaml --no-wait

Paths in the config are read where the job runs: with a working directory
(default ``.``, uploaded by Ray, ``.gitignore`` respected) relative paths point
into Ray's temporary copy of it, so keep ``output.dir`` absolute (or on shared
storage): rows written inside that copy are lost when Ray cleans it up, and a
resubmission would not find them to resume. The command warns when it is not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

__all__ = ["add_arguments", "main", "run"]

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, help="batch YAML (relative to the working directory if uploaded)")
    parser.add_argument("--address", default=os.environ.get("RAY_JOB_ADDRESS", "http://127.0.0.1:8265"),
                        help="the cluster's job API (dashboard) address; default $RAY_JOB_ADDRESS or "
                        "http://127.0.0.1:8265")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override passed to the job (repeatable)")
    upload = parser.add_mutually_exclusive_group()
    upload.add_argument("--working-dir", default=".", help="folder uploaded as the job's working directory (default .)")
    upload.add_argument("--no-working-dir", action="store_true",
                        help="upload nothing; the config's paths must exist on the cluster")
    parser.add_argument("--entrypoint-num-cpus", type=float, default=0,
                        help="CPUs the driver reserves (1 on clusters whose head has none, so it runs on a worker)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the job (repeatable), e.g. VLLM_CPU_KVCACHE_SPACE=1")
    parser.add_argument("--python", default="python", help="interpreter on the cluster (default: python on its PATH)")
    parser.add_argument("--submission-id", help="job id to use (default: Ray picks one)")
    parser.add_argument("--no-wait", action="store_true", help="submit and exit without following the log")
    return parser


def check_config(args: argparse.Namespace) -> str | None:
    """Validate the config locally; returns a warning to print, raises BatchConfigError."""
    from .config import load_config

    where = Path(args.config) if args.no_working_dir else Path(args.working_dir) / args.config
    if not where.exists():
        # Only on the cluster (e.g. --no-working-dir with a cluster path): it checks there.
        return None
    config = load_config(where, args.overrides)
    if not args.no_working_dir and not Path(config.output.dir).is_absolute():
        return (f"warning: output.dir {config.output.dir!r} is relative: the rows would land in Ray's temporary "
                "copy of the working directory and be lost for resuming; pass "
                "--set output.dir=/absolute/or/shared/path")
    return None


def entrypoint(args: argparse.Namespace) -> str:
    parts = [args.python, "-m", "nnsight_ray.batch", "--config", args.config]
    for override in args.overrides:
        parts += ["--set", override]
    return " ".join(shlex.quote(p) for p in parts)


def runtime_env(args: argparse.Namespace) -> dict:
    env: dict = {}
    if not args.no_working_dir:
        env["working_dir"] = args.working_dir
    variables = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--env {item!r}: expected KEY=VALUE")
        variables[key] = value
    if variables:
        env["env_vars"] = variables
    return env


async def follow(client, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)


def run(args: argparse.Namespace) -> int:
    """Submit (and follow) the job ``args`` describe; the exit status."""
    from .errors import BatchConfigError

    try:
        warning = check_config(args)
    except BatchConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if warning:
        print(warning, file=sys.stderr)

    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(args.address)
    kwargs = {"entrypoint_num_cpus": args.entrypoint_num_cpus} if args.entrypoint_num_cpus else {}
    job_id = client.submit_job(entrypoint=entrypoint(args), runtime_env=runtime_env(args),
                               submission_id=args.submission_id, **kwargs)
    print(f"submitted job {job_id} to {args.address}: {entrypoint(args)}", flush=True)
    print(f"  follow: ray job logs --address {args.address} -f {job_id}", flush=True)
    print(f"  stop:   ray job stop --address {args.address} {job_id}", flush=True)
    if args.no_wait:
        return 0
    try:
        asyncio.run(follow(client, job_id))
    except KeyboardInterrupt:
        print(f"\nstopped following; job {job_id} keeps running", file=sys.stderr)
        return 1
    status = str(client.get_job_status(job_id))
    while status.split(".")[-1] not in TERMINAL:  # the log can end a moment before the status
        time.sleep(1)
        status = str(client.get_job_status(job_id))
    status = status.split(".")[-1]
    print(f"job {job_id}: {status}", flush=True)
    return 0 if status == "SUCCEEDED" else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nnsight-ray submit", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
