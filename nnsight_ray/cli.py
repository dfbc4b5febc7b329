"""``nnsight-ray``: the project's command line.

Usage::

    nnsight-ray batch --config run.yaml [--set key=value ...] [--address HOST:PORT | --local-cluster N]
    nnsight-ray submit --config run.yaml [--address http://HOST:8265] [--set key=value ...] [--env KEY=VALUE ...]
    nnsight-ray compare-layouts [--model DIR] [--layouts 2x1,1x2,2x2] [--strategies SPREAD,...]
    nnsight-ray build-model PATH [--arch llama|gpt2] [--seed N]
    nnsight-ray demo

``batch`` is ``python -m nnsight_ray.batch`` (same arguments, same exit codes);
``submit`` sends a batch config to a Ray cluster as a Ray job and follows its
log (``nnsight_ray.batch.submit``); ``compare-layouts`` checks one trace under
several TP x PP x placement layouts against the single-rank run
(``nnsight_ray.compare_layouts``); ``build-model`` writes the seeded tiny test
checkpoint (``nnsight_ray.models``); ``demo`` is ``python -m nnsight_ray.demo``.
``python -m nnsight_ray.cli ...`` is the same as ``nnsight-ray ...``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]

COMMANDS = ("batch", "submit", "compare-layouts", "build-model", "demo")


def _summary(doc: str | None) -> str:
    """A module docstring's first paragraph, without its ````command````: prefix."""
    first = " ".join((doc or "").split("\n\n")[0].split(": ", 1)[-1].split())
    return first[:1].upper() + first[1:]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="nnsight-ray", description="nnsight_ray: batch runs and jobs, layout "
                                     "checks, the tiny test model, the demo job.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")

    from . import compare_layouts
    from .batch import submit
    from .batch.__main__ import add_arguments

    batch = commands.add_parser("batch", help="run a batch config (python -m nnsight_ray.batch)")
    add_arguments(batch)
    submitting = commands.add_parser("submit", help="submit a batch config as a Ray job and follow it",
                                     description=_summary(submit.__doc__), epilog=submit.__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    submit.add_arguments(submitting)
    comparing = commands.add_parser("compare-layouts", help="check one trace under TP x PP layouts against one rank",
                                    description=_summary(compare_layouts.__doc__),
                                    epilog=compare_layouts.__doc__.split("\n\n", 1)[1],
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    compare_layouts.add_arguments(comparing)
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
    if args.command == "submit":
        return submit.run(args)
    if args.command == "compare-layouts":
        return compare_layouts.run(compare_layouts.check_arguments(comparing, args))
    from .batch.__main__ import run_from_args

    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
