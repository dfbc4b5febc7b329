"""Progress: a tqdm bar on a terminal, a log line every few seconds elsewhere.

Ray job logs (``ray job logs -f``, the dashboard, KubeRay's submitter pod) are
not terminals: a tqdm bar there is either a wall of carriage returns or nothing
until the end. So when stdout is not a tty, the same numbers (done/total,
prompts/s over the run, ETA, errors) go out as one plain line every
``interval_s`` seconds, through this module's logger and stdout.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

logger = logging.getLogger(__name__)

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    seconds = int(round(max(seconds, 0)))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"


class Progress:
    def __init__(self, total: int, initial: int = 0, interval_s: float = 5.0,
                 stream: TextIO | None = None, interactive: bool | None = None) -> None:
        self.total = total
        self.done = initial
        self.initial = initial
        self.errors = 0
        self.interval_s = interval_s
        self.stream = stream or sys.stdout
        self.started = time.monotonic()
        self._last_line = self.started
        interactive = self.stream.isatty() if interactive is None else interactive
        self.bar = None
        if interactive:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="prompt", dynamic_ncols=True,
                            desc="batch", smoothing=0.1)

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return (self.done - self.initial) / elapsed if elapsed > 0 else 0.0

    def update(self, n: int, errors: int = 0) -> None:
        self.done += n
        self.errors += errors
        if self.bar is not None:
            self.bar.update(n)
            if errors:
                self.bar.set_postfix(errors=self.errors, refresh=False)
        self.tick()

    def tick(self) -> None:
        """Emit a line if ``interval_s`` passed (non-interactive only)."""
        if self.bar is not None:
            return
        now = time.monotonic()
        if now - self._last_line >= self.interval_s:
            self._last_line = now
            self.line()

    def line(self) -> str:
        rate = self.rate
        left = self.total - self.done
        eta = format_duration(left / rate) if rate > 0 else "?"
        percent = 100.0 * self.done / self.total if self.total else 100.0
        text = (f"batch: {self.done}/{self.total} prompts ({percent:.1f}%), {rate:.1f} prompts/s, "
                f"ETA {eta}, elapsed {format_duration(time.monotonic() - self.started)}, errors {self.errors}")
        if self.bar is None:
            print(text, file=self.stream, flush=True)
        logger.debug(text)
        return text

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.done != self.initial:
            self.line()
