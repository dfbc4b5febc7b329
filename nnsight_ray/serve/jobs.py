"""Jobs of nnsight's ``remote=True`` protocol, shared by every replica: the logic, without Ray.

nnsight's ``RemoteBackend`` opens ``WS /subscribe`` and posts ``POST /request``
as two connections, which Serve may route to two different replicas; a
non-blocking client polls ``GET /response/{id}`` on whichever replica it
reaches, and downloads a large result from a URL on yet another. So no replica
may keep a job's state for itself: one ``JobBook`` per application (the Serve
edge wraps it in the ``NNsightJobs`` deployment) holds every job's status,
every subscription's pending frames and every result not yet fetched.

Every accepted job ends. A job moves RECEIVED -> QUEUED -> RUNNING ->
COMPLETED or ERROR (nnsight's ``Status``); the replica running it reports each
step and bounds the run with its own timeout, and the book gives a job up
(ERROR) once ``deadline_s`` has passed with no final status, so a replica that
died mid-job still ends its jobs. Once final, a status never changes.

Memory is bounded:

- a result larger than ``max_result_bytes`` is refused (the job ends in ERROR
  saying so), and one that would take the stored results past
  ``max_stored_bytes`` too;
- a result up to ``inline_result_bytes`` rides the subscription as one binary
  frame (``ResponseModel.pickle()``, as NDIF sends it) and is dropped once
  sent; a larger one, and every result of a non-blocking job, waits behind a
  capability URL (``/download/<token>``, an unguessable token, no header
  needed) until it is downloaded once or ``result_ttl_s`` passes;
- a finished job's record is forgotten ``result_ttl_s`` after it ended; a
  subscription is forgotten when its client leaves (or its replica stops
  asking for its frames), and the results of its unfinished jobs are dropped
  as they arrive (nobody is left to take them).

Times come from an injected clock and tokens from an injected source, so the
unit tests drive all of it on fakes.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DOWNLOAD_PATH", "Job", "JobBook", "JobLimits", "UnknownSession"]

DOWNLOAD_PATH = "/download/"
#: A subscription whose replica has not asked for frames this long is gone (the replica asks every few seconds).
SESSION_IDLE_S = 60.0
FINAL = frozenset({"COMPLETED", "ERROR"})
ORDER = ("RECEIVED", "QUEUED", "RUNNING", "COMPLETED", "ERROR")


class UnknownSession(KeyError):
    """A request names a subscription this application does not hold (never opened, or its client left)."""

    def __str__(self) -> str:
        return (f"unknown session_id {self.args[0]!r}: open WS /subscribe on this server first "
                "(nnsight's RemoteBackend does), or send an empty session_id and poll GET /response/<id>")


class JobLimits(BaseModel):
    """How long jobs and results live, and how large results may be."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_timeout_s: float = Field(600.0, gt=0, description="A job still running after this long ends in ERROR.")
    result_ttl_s: float = Field(600.0, gt=0, description="A finished job (and a result not fetched) is kept this long.")
    max_result_bytes: int = Field(256 << 20, gt=0, description="Largest result kept; a larger one ends in ERROR.")
    max_stored_bytes: int = Field(1 << 30, gt=0, description="All results kept at once; past it new ones end in ERROR.")
    inline_result_bytes: int = Field(
        8 << 20, ge=0, description="Results up to this size ride the websocket; larger ones are downloaded by URL.")

    @property
    def deadline_s(self) -> float:
        """When the book gives a job up: the replica's own timeout, plus time for its report to arrive."""
        return self.job_timeout_s + 30.0


@dataclass
class Job:
    id: str
    session: str  # "" for a non-blocking job (polled)
    model_key: str
    replica: str  # the replica running it
    subscriber: str | None  # the replica holding its subscription
    status: str
    description: str
    created: float
    ended: float | None = None
    result: bytes | None = None
    token: str | None = None

    def response(self, data: Any = None) -> dict[str, Any]:
        """The job as nnsight's ``ResponseModel`` fields (JSON-ready unless ``data`` is bytes)."""
        return {"id": self.id, "status": self.status, "description": self.description, "data": data}


@dataclass
class Session:
    id: str
    replica: str
    polled: float  # when its replica last asked for frames
    frames: list[tuple[str, str, str]] = field(default_factory=list)  # (job id, status, description), in order
    wake: asyncio.Event | None = None

    def event(self) -> asyncio.Event:
        if self.wake is None:
            self.wake = asyncio.Event()
        return self.wake


class JobBook:
    """Every job, subscription and stored result of one application.

    Args:
        limits: the bounds above.
        clock: seconds, monotonic.
        token: a new unguessable download token.
    """

    def __init__(self, limits: JobLimits | None = None, clock: Callable[[], float] = time.monotonic,
                 token: Callable[[], str] = lambda: secrets.token_urlsafe(32)) -> None:
        self.limits = limits or JobLimits()
        self.clock = clock
        self.new_token = token
        self.jobs: dict[str, Job] = {}
        self.sessions: dict[str, Session] = {}
        self.downloads: dict[str, str] = {}  # token -> job id

    # -- subscriptions ----------------------------------------------------------

    def open_session(self, replica: str) -> str:
        session = Session(uuid.uuid4().hex, replica, self.clock())
        self.sessions[session.id] = session
        return session.id

    def close_session(self, session_id: str) -> None:
        """The client left: forget the subscription; its jobs run on, their results are dropped."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        session.event().set()  # a waiter returns None at once
        for job in self.jobs.values():
            if job.session == session_id and job.token is None:
                self._drop_result(job)

    async def next_frames(self, session_id: str, base_url: str, timeout: float) -> list[tuple[str, Any]] | None:
        """The frames to send on a subscription: ``("text", json)`` or ``("bytes", pickle)``.

        Waits up to ``timeout`` for one; ``[]`` if none came, ``None`` once the
        subscription is gone (closed, or never opened here).
        """
        session = self.sessions.get(session_id)
        if session is None:
            return None
        session.polled = self.clock()
        if not session.frames:
            wake = session.event()
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), timeout)
            except asyncio.TimeoutError:
                return []
            if self.sessions.get(session_id) is not session:
                return None
        pending, session.frames = session.frames, []
        return [self._frame(self.jobs[i], status, description, base_url) for i, status, description in pending
                if i in self.jobs]

    def _frame(self, job: Job, status: str, description: str, base_url: str) -> tuple[str, Any]:
        """One status as it was when it happened; a COMPLETED one carries the result or its URL."""
        if status == "COMPLETED" and job.result is not None and job.token is None:
            from nnsight.schema.response import ResponseModel

            frame = ResponseModel(id=job.id, status=status, description=description, data=job.result).pickle()
            self._drop_result(job)  # sent: the subscription was its only reader
            return "bytes", frame
        url = self._url(job, base_url) if status == "COMPLETED" else None
        return "text", json.dumps({"id": job.id, "status": status, "description": description, "data": url})

    # -- jobs -------------------------------------------------------------------

    def accept(self, model_key: str, session_id: str, replica: str) -> dict[str, Any]:
        """Record a new job (RECEIVED); its response for ``POST /request``."""
        if session_id and session_id not in self.sessions:
            raise UnknownSession(session_id)
        subscriber = self.sessions[session_id].replica if session_id else None
        job = Job(uuid.uuid4().hex, session_id, model_key, replica, subscriber, "RECEIVED",
                  "Your job has been received and is waiting to be queued.", self.clock())
        self.jobs[job.id] = job
        return job.response()

    def update(self, job_id: str, status: str, description: str = "") -> bool:
        """Move a job forward (QUEUED, RUNNING); False if it is unknown or already final."""
        job = self.jobs.get(job_id)
        if job is None or job.status in FINAL or ORDER.index(status) <= ORDER.index(job.status):
            return False
        job.status, job.description = status, description
        self._notify(job)
        return True

    def fail(self, job_id: str, description: str) -> bool:
        job = self.jobs.get(job_id)
        if job is None or job.status in FINAL:
            return False
        self._end(job, "ERROR", description)
        return True

    def complete(self, job_id: str, result: bytes) -> bool:
        """Store a job's result (or end it in ERROR when it breaks a bound)."""
        job = self.jobs.get(job_id)
        if job is None or job.status in FINAL:
            return False
        size, limits = len(result), self.limits
        if size > limits.max_result_bytes:
            return self._end(job, "ERROR", f"the result is {size} bytes, over this server's max_result_bytes "
                             f"({limits.max_result_bytes}); save less (a slice, a mean) or raise the limit")
        if job.session and job.session not in self.sessions:
            return self._end(job, "COMPLETED", "completed; its client had left, so the result was dropped")
        stored = self.stored_bytes()
        if stored + size > limits.max_stored_bytes:
            return self._end(job, "ERROR", f"the server's result store is full ({stored} of "
                             f"{limits.max_stored_bytes} bytes held for other jobs); try again shortly, or save less")
        job.result = result
        if not job.session or size > limits.inline_result_bytes:
            job.token = self.new_token()
            self.downloads[job.token] = job.id
        return self._end(job, "COMPLETED", "Your job has been completed.")

    def _end(self, job: Job, status: str, description: str) -> bool:
        job.status, job.description, job.ended = status, description, self.clock()
        self._notify(job)
        return True

    def _notify(self, job: Job) -> None:
        session = self.sessions.get(job.session) if job.session else None
        if session is not None:
            session.frames.append((job.id, job.status, job.description))
            session.event().set()

    def _drop_result(self, job: Job) -> None:
        job.result = None
        if job.token is not None:
            self.downloads.pop(job.token, None)
            job.token = None

    # -- reads --------------------------------------------------------------------

    @staticmethod
    def _url(job: Job, base_url: str) -> str | None:
        return f"{base_url.rstrip('/')}{DOWNLOAD_PATH}{job.token}" if job.token is not None else None

    def response(self, job_id: str, base_url: str) -> dict[str, Any]:
        """``GET /response/<id>``: the job's latest status; a COMPLETED one carries its download URL.

        An unknown id (never accepted here, or forgotten after ``result_ttl_s``)
        is an ERROR, not a 404: nnsight's client reads 404 as "not yet" and
        would poll forever.
        """
        job = self.jobs.get(job_id)
        if job is None:
            return {"id": job_id, "status": "ERROR", "data": None,
                    "description": f"no job {job_id!r} on this server: unknown, or forgotten "
                    f"{self.limits.result_ttl_s:g} s after it ended"}
        if job.status == "COMPLETED" and job.token is None:
            return {**job.response(), "status": "ERROR",
                    "description": "the result was already fetched, dropped, or expired"}
        return job.response(self._url(job, base_url))

    def take_download(self, token: str) -> bytes | None:
        """The result behind a download token, once; ``None`` if unknown, fetched or expired."""
        job_id = self.downloads.pop(token, None)
        job = self.jobs.get(job_id) if job_id else None
        if job is None or job.result is None:
            return None
        result = job.result
        job.result, job.token = None, None
        return result

    def stored_bytes(self) -> int:
        return sum(len(j.result) for j in self.jobs.values() if j.result is not None)

    def stats(self) -> dict[str, Any]:
        by_status: dict[str, int] = {}
        for job in self.jobs.values():
            by_status[job.status] = by_status.get(job.status, 0) + 1
        ran: dict[str, int] = {}
        running: dict[str, int] = {}  # jobs not yet final, by the replica running them
        for job in self.jobs.values():
            ran[job.replica] = ran.get(job.replica, 0) + 1
            if job.status not in FINAL:
                running[job.replica] = running.get(job.replica, 0) + 1
        crossed = sum(1 for j in self.jobs.values() if j.subscriber is not None and j.subscriber != j.replica)
        return {"jobs": by_status, "sessions": len(self.sessions), "stored_bytes": self.stored_bytes(),
                "downloads": len(self.downloads), "ran_on": ran, "running_on": running,
                "crossed_replicas": crossed}

    def job(self, job_id: str) -> dict[str, Any] | None:
        job = self.jobs.get(job_id)
        return None if job is None else {**job.response(), "session": job.session, "replica": job.replica,
                                         "subscriber": job.subscriber, "stored": job.result is not None}

    # -- time -----------------------------------------------------------------------

    def sweep(self) -> None:
        """End jobs past their deadline; forget finished jobs and their results after ``result_ttl_s``, and
        subscriptions whose replica stopped asking for frames (it died) after ``SESSION_IDLE_S``."""
        now, limits = self.clock(), self.limits
        for session in list(self.sessions.values()):
            if now - session.polled > SESSION_IDLE_S:
                self.close_session(session.id)
        for job in list(self.jobs.values()):
            if job.status not in FINAL and now - job.created > limits.deadline_s:
                self._end(job, "ERROR", f"no result within {limits.deadline_s:g} s (the replica running it "
                          "stopped, or the engine hung); the job was given up")
            elif job.ended is not None and now - job.ended > limits.result_ttl_s:
                self._drop_result(job)
                del self.jobs[job.id]
