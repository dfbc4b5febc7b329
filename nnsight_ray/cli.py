"""``nnsight-ray``: the project's command line.

Usage::

    nnsight-ray batch --config run.yaml [--set key=value ...] [--address HOST:PORT | --local-cluster N]
    nnsight-ray build-model PATH [--arch llama|gpt2] [--seed N]
    nnsight-ray demo

``batch`` is ``python -m nnsight_ray.batch`` (same arguments, same exit codes);
``build-model`` writes the seeded tiny test checkpoint (``nnsight_ray.models``);
``demo`` is ``python -m nnsight_ray.demo``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="nnsight-ray",
                                     description="nnsight_ray: batch runs, the tiny test model, the demo job.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{batch,build-model,demo}")

    from .batch.__main__ import add_arguments

    batch = commands.add_parser("batch", help="run a batch config (python -m nnsight_ray.batch)")
    add_arguments(batch)
    commands.add_parser("build-model", help="write the seeded tiny test checkpoint", add_help=False)
    commands.add_parser("demo", help="the README's demo job (python -m nnsight_ray.demo)", add_help=False)

    # build-model and demo parse their own arguments.
    if argv and argv[0] == "build-model":
        from .models import main as build_model

        build_model(argv[1:])
        return 0
    if argv and argv[0] == "demo":
        from .demo import main as demo

        return demo(argv[1:])
    args = parser.parse_args(argv)
    from .batch.__main__ import run_from_args

    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
