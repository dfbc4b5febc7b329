"""A run's folder: ``manifest.json``, ``errors.jsonl``, the check that it can be written. Pure I/O, no Ray.

The rows themselves (``data/``), Ray Data's checkpoint (``checkpoint/``) and an
activation dataset's files (``activations/``) are the pipeline's (``pipeline``).
``RunDir`` holds the run's fingerprint (its inputs' digest): a folder written
from other inputs is refused rather than resumed. Before any of it,
``check_writable`` (preflight) refuses an ``output.dir`` that cannot be written,
or whose path runs through a file, naming the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from .errors import BatchConfigError

__all__ = ["RunDir", "check_writable", "fingerprint_digest"]


def check_writable(path: Path) -> None:
    """Refuse (``BatchConfigError``) an ``output.dir`` a run could not write: a file on its path, or no write access.

    Nothing is left behind: the probe is an anonymous temporary file in the
    folder (or, for a folder still to be created, in its nearest existing parent).
    """
    where = str(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "it is a file" if existing == path else f"{str(existing)!r} on its path is a file"
        raise BatchConfigError(f"output.dir {where!r}: {what}, not a folder; choose another output.dir "
                               "(--set output.dir=...)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        place = "cannot write there" if existing == path else f"cannot create it in {str(existing)!r}"
        raise BatchConfigError(f"output.dir {where!r}: {place} ({type(error).__name__}: {error.strerror or error}); "
                               "choose a folder you can write (--set output.dir=...)") from None


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()


class RunDir:
    """The run folder: the resume check against its inputs, atomic writes of its manifest and errors."""

    def __init__(self, path: str | os.PathLike, fingerprint: dict[str, Any]) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.digest = fingerprint_digest(fingerprint)

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def errors_path(self) -> Path:
        return self.path / "errors.jsonl"

    def previous_manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            raise BatchConfigError(f"output.dir {str(self.path)!r}: a file on its path is not a folder; choose "
                                   "another output.dir (--set output.dir=...)") from None
        except (OSError, ValueError) as error:
            raise BatchConfigError(
                f"output.dir {str(self.path)!r}: manifest.json is unreadable ({error}); move it away to start over"
            ) from None

    def check_compatible(self) -> dict[str, Any] | None:
        """Refuse to resume a folder written from other inputs; returns the old manifest."""
        previous = self.previous_manifest()
        if previous is None:
            return None
        old = previous.get("fingerprint") or {}
        if fingerprint_digest(old) == self.digest:
            return previous
        changed = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
        raise BatchConfigError(
            f"output.dir {str(self.path)!r} holds a run of different inputs (changed: {', '.join(changed)}); "
            "resuming would mix them. Use another output.dir (--set output.dir=...) or delete that folder."
        )

    def prepare(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # checked in preflight; changed since
            raise BatchConfigError(f"output.dir {str(self.path)!r}: cannot create it ({type(error).__name__}: "
                                   f"{error.strerror or error})") from None
        for stale in self.path.glob("*.tmp-*"):
            try:
                stale.unlink()
            except OSError:
                pass

    def write_atomic(self, path: Path, data: bytes) -> None:
        """``data`` into ``path`` whole or not at all: a temporary file beside it, fsynced, renamed over it."""
        tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
