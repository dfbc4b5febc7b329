"""The errors a batch run raises on purpose, and what each means for a rerun."""

from __future__ import annotations

from ..errors import NNsightRayError


class BatchConfigError(ValueError):
    """The run's config or inputs are wrong; nothing was started. Fix the message's
    key or file and run again."""


class BatchRunError(NNsightRayError):
    """The run stopped before every shard was written (engines died, shards ran
    out of retries). Finished shards are kept: rerunning the same command
    resumes with the rest."""

    recoverable = False
