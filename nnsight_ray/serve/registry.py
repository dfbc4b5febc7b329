"""Registered blocks for every replica of an application: the logic, without Ray.

``model.edit(serve=url)`` reaches one replica over HTTP, but the block has to
run on every engine behind the route, including engines of replicas that start
later (a scale-up, a replica restarted after a crash). One registry per
application records ``(id, name, payload)`` in installation order and knows
which engines are attached:

- ``register`` / ``clear`` install or remove a block on every attached engine,
  then record it. An install that one live engine refuses (a corrupt payload)
  is rolled back on the engines that took it and reported; nothing is
  recorded. Engines found dead are detached, not reported.
- ``attach`` replays every recorded block, in order, onto a newly started
  engine before adding it, so a replica serves nothing without them.

Operations run one at a time (one lock): a replay and a concurrent clear can
never interleave into a block left installed on one engine only.

The engine calls come in through ``rpc(engine, method, args)``; the Serve edge
(``deployment.NNsightRegistry``) supplies one that calls the engine actor, tests
a fake.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

__all__ = ["RegistrationError", "Registry"]

logger = logging.getLogger(__name__)

Rpc = Callable[[str, str, tuple], Awaitable[Any]]


class RegistrationError(RuntimeError):
    """An engine refused to install a block; it is installed nowhere. Fix the block and retry."""


@dataclass(frozen=True)
class Entry:
    id: str
    name: str | None
    payload: bytes


class Registry:
    """The blocks installed on an application's engines, and those engines.

    Args:
        rpc: ``await rpc(engine, method, args)`` calls ``method`` on every rank
            of ``engine``.
        is_dead: tells an exception meaning "that engine is gone" from one
            meaning "it refused this call".
    """

    def __init__(self, rpc: Rpc, is_dead: Callable[[BaseException], bool]) -> None:
        self._rpc = rpc
        self._is_dead = is_dead
        self.entries: dict[str, Entry] = {}
        self.engines: list[str] = []
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _everywhere(self, method: str, args: tuple) -> dict[str, BaseException]:
        """Call ``method`` on every attached engine; detach dead ones; return the refusals."""
        engines = list(self.engines)
        results = await asyncio.gather(*(self._rpc(e, method, args) for e in engines), return_exceptions=True)
        refusals = {}
        for engine, result in zip(engines, results):
            if not isinstance(result, BaseException):
                continue
            if self._is_dead(result):
                logger.warning("registry: engine %s is gone (%s); detaching it", engine, result)
                self.engines.remove(engine)
            else:
                refusals[engine] = result
        return refusals

    async def register(self, id: str, name: str | None, payload: bytes) -> dict[str, Any]:
        """Install a block on every attached engine and record it (re-registering an id replaces it)."""
        async with self.lock:
            refusals = await self._everywhere("nnsight_register", (id, payload, name))
            if refusals:
                await self._everywhere("nnsight_clear_registered", (id,))
                self.entries.pop(id, None)
                engine, error = next(iter(refusals.items()))
                raise RegistrationError(f"engine {engine} refused registration {id}: {error}")
            self.entries.pop(id, None)
            self.entries[id] = Entry(id, name, payload)
            return {"id": id, "name": name, "engines": len(self.engines)}

    async def clear(self, id: str) -> dict[str, Any]:
        """Remove a block everywhere. Unknown ids are a no-op, as on one engine."""
        async with self.lock:
            self.entries.pop(id, None)
            refusals = await self._everywhere("nnsight_clear_registered", (id,))
            if refusals:
                engine, error = next(iter(refusals.items()))
                raise RegistrationError(f"engine {engine} could not clear registration {id}: {error}")
            return {"id": id, "engines": len(self.engines)}

    async def attach(self, engine: str) -> dict[str, Any]:
        """Replay every recorded block onto ``engine``, then fan future ones out to it too.

        A block the new engine refuses (it installed everywhere else) is logged
        and reported in ``failed``; the engine is attached regardless.
        """
        async with self.lock:
            failed = []
            for entry in self.entries.values():
                try:
                    await self._rpc(engine, "nnsight_register", (entry.id, entry.payload, entry.name))
                except Exception as error:
                    if self._is_dead(error):
                        raise
                    logger.error("registry: engine %s refused replayed registration %s: %s", engine, entry.id, error)
                    failed.append(entry.id)
            if engine not in self.engines:
                self.engines.append(engine)
            return {"engine": engine, "replayed": len(self.entries) - len(failed), "failed": failed}

    async def detach(self, engine: str) -> None:
        async with self.lock:
            if engine in self.engines:
                self.engines.remove(engine)

    def status(self) -> dict[str, Any]:
        return {"engines": list(self.engines),
                "registrations": [{"id": e.id, "name": e.name, "bytes": len(e.payload)} for e in self.entries.values()]}
