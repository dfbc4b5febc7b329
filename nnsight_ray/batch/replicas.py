"""A batch run's engines, the Ray edge: the replicas, their traces in flight, what a failure means.

``start_replicas`` starts the ``RayVLLM`` deployments together; ``Replica``
is one of them (or an engine the caller handed in) with the traces it has in
flight; ``submit_trace`` sends one non-blocking trace of a chunk of prompts,
``submit_extract`` / ``commit_extract`` / ``collect_commits`` the requests of an
activation chunk and its files' commits (``formats`` says which a run uses).
``classify`` tells an engine's loss from one request's failure, and
``error_info`` turns a request's error into its row of ``errors.jsonl``.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .config import EngineConfig
from .scheduler import Chunk

logger = logging.getLogger(__name__)

__all__ = ["InFlight", "Replica", "classify", "collect_commits", "commit_extract", "discard_extract", "error_info",
           "part_name", "part_rows", "start_replicas", "submit_extract", "submit_trace", "where"]


def submit_trace(model: Any, texts: list[str], fn: Callable, sampling: dict[str, Any]) -> Any:
    """One non-blocking trace, one invoke per prompt; its ref resolves to ``{"rows": [...]}`` (or raises).

    ``rows`` is bound and saved above the invokes, so each request's copy
    carries its own slot and nnsight merges them slot-wise.
    """
    import nnsight

    with model.trace(blocking=False, **sampling) as tracer:
        rows = nnsight.save([None] * len(texts))
        for i, text in enumerate(texts):
            with tracer.invoke(text):
                rows[i] = fn(model, tracer)
    return tracer.ref


@dataclass
class InFlight:
    """A chunk's request in flight on a replica; ``ref`` is what its result comes back on."""

    chunk: Chunk
    replica: "Replica"
    submitted: float
    part: str | None = None  # activations: the part file the ranks keep the chunk's rows under
    commits: list[Any] | None = None  # activations, second phase: each rank's commit of ``part``
    ref: Any = None


def part_name(shard: int, positions: Sequence[int], shard_prompts: int) -> str:
    """An activation chunk's file stem: the shard's, or (a chunk retried alone) the shard's and its first prompt."""
    whole = len(positions) == shard_prompts and tuple(positions) == tuple(range(shard_prompts))
    return f"shard-{shard:05d}" if whole else f"shard-{shard:05d}-p{positions[0]:06d}"


def submit_extract(model: Any, texts: list[str], part: str, directory: str, locations: list[str],
                   indices: list[int], dtype: str | None, sampling: dict[str, Any], generated: bool = False) -> Any:
    """The chunk's prompts as plain requests whose rows the ranks keep under ``part``; a ref to the outputs."""
    return model.vllm_entrypoint.extract_async(texts, part, directory, locations, indices=indices, dtype=dtype,
                                               max_tokens=sampling["max_tokens"],
                                               temperature=sampling.get("temperature", 0.0), generated=generated)


def commit_extract(model: Any, part: str, fsync: bool) -> list[Any]:
    """Have the writing ranks write ``part``'s files; one ref per rank, each resolving to what it wrote (or None)."""
    return model.vllm_entrypoint.extract_commit(part, fsync=fsync)


def discard_extract(model: Any, part: str) -> None:
    """Drop the rows the ranks keep for ``part`` (its requests failed)."""
    model.vllm_entrypoint.extract_discard(part)


def collect_commits(commits: list[Any], part: str) -> list[dict[str, Any]] | BaseException:
    """What each writing rank wrote of ``part``: ``{"file", "rows", "bytes", "prompts"}``; the error if one failed."""
    import ray

    from .._internal.cluster.ray_errors import get as ray_get

    try:
        return [w for w in ray_get(commits) if w is not None]
    except Exception as error:  # a rank died while writing
        return error if isinstance(error, ray.exceptions.RayError) else RuntimeError(f"writing {part}: {error}")


def part_rows(written: list[dict[str, Any]], indices: Sequence[int]) -> tuple[list[str], list[int | None]]:
    """A committed part's file names (one per pipeline stage that wrote one) and each prompt's token rows in them.

    A prompt's count is None when the writing ranks do not all hold the same rows of it (vLLM never ran it whole).
    """
    from pathlib import Path

    files = [Path(w["file"]).name for w in written if w.get("file")]
    counts: list[int | None] = []
    for index in indices:
        seen = {w["prompts"].get(index) for w in written}
        counts.append(seen.pop() if len(seen) == 1 and None not in seen else None)
    return files, counts


class Replica:
    """One engine deployment and the traces it has in flight."""

    def __init__(self, index: int, model: Any, owned: bool, start_s: float = 0.0) -> None:
        self.index = index
        self.model = model
        self.owned = owned
        self.start_s = start_s
        self.generation = 0
        self.restarts = 0
        self.alive = True
        self.in_flight: dict[Any, InFlight] = {}
        self.prompts_in_flight = 0
        self.served = 0
        self.topology: list[dict[str, Any]] = []
        try:
            self.topology = model.topology()
        except Exception:  # a LocalVLLM-like engine without one
            logger.debug("replica %d has no topology", index, exc_info=True)

    @property
    def name(self) -> str:
        return getattr(self.model, "name", None) or f"replica{self.index}"

    def describe(self) -> dict[str, Any]:
        # From the ranks themselves: a client attached by name does not know the layout.
        return {
            "index": self.index,
            "name": self.name,
            "owned": self.owned,
            "alive": self.alive,
            "restarts": self.restarts,
            "start_s": round(self.start_s, 3),
            "tensor_parallel_size": len({t.get("tp_rank") for t in self.topology}) or None,
            "pipeline_parallel_size": len({t.get("pp_rank") for t in self.topology}) or None,
            "prompts_served": self.served,
            "topology": self.topology,
        }

    def shutdown(self) -> None:
        if self.owned and self.model is not None:
            try:
                self.model.shutdown()
            except Exception:
                logger.warning("replica %s did not shut down cleanly", self.name, exc_info=True)


def start_replicas(indices: Sequence[int], model_path: str, engine: EngineConfig, tag: str,
                   generation: int = 0) -> list[Replica]:
    """Start the engine deployments together (``RayVLLM.start_many``), one client each.

    Their starts overlap: N replicas take about as long as one where nodes are
    separate. If one fails, the others are shut down and its error is raised.
    """
    from ..ray_vllm import RayVLLM

    names = [f"batch-{tag}-r{i}" + (f"-g{generation}" if generation else "") for i in indices]
    for name in names:
        logger.info("starting engine replica %s (tp=%d, pp=%d, %s)", name, engine.tensor_parallel_size,
                    engine.pipeline_parallel_size, engine.placement_strategy)
    started = time.monotonic()
    models = RayVLLM.start_many(
        model_path, {name: {} for name in names}, **engine.engine_kwargs,
        **engine.placement.model_dump(exclude_defaults=True), tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
    )
    start_s = time.monotonic() - started
    replicas = []
    for index, name in zip(indices, names):
        replica = Replica(index, models[name], owned=True, start_s=start_s)
        replica.generation = generation
        replicas.append(replica)
        logger.info("replica %s ready in %.1f s: %s", name, start_s, where(replica.topology))
    return replicas


def where(topology: list[dict[str, Any]]) -> str:
    return ", ".join(f"pp{t.get('pp_rank')}.tp{t.get('tp_rank')} on node {str(t.get('node_id'))[:8]}"
                     for t in sorted(topology, key=lambda t: t.get("rank", 0))) or "?"


def classify(error: BaseException) -> str:
    """``"lost"`` when the engine (not the request) failed, else ``"request"``."""
    import ray

    from ..errors import NNsightRayError

    if isinstance(error, NNsightRayError) and not error.recoverable:
        return "lost"  # the engine is gone (EngineDeadError), not just this request
    if isinstance(error, ray.exceptions.RayError) and not isinstance(error, ray.exceptions.RayTaskError):
        return "lost"  # object lost, owner died, actor died
    return "request"


_TYPED_MESSAGE = re.compile(r"^(\w+(?:\.\w+)*): (.*)$", re.S)


def error_info(type_name: str, message: str, traceback: str | None = None) -> dict[str, Any]:
    """``{"type", "message", "traceback"}``, unwrapping nnsight's ``RuntimeError("ValueError: ...")``."""
    head, _, rest = message.partition("\n\nIntervention traceback:\n")
    match = _TYPED_MESSAGE.match(head)
    if type_name in ("RuntimeError", "RequestError") and match:
        type_name, head = match.group(1).rsplit(".", 1)[-1], match.group(2)
    elif match and match.group(1) == type_name:
        head = match.group(2)
    info = {"type": type_name, "message": head.strip()}
    # The intervention's own traceback (inside nnsight's message) points at the
    # user's line; the deferred one only at where it was re-raised.
    if rest or traceback:
        info["traceback"] = (rest or traceback).rstrip()
    return info
