"""Rank identities and CPU binding: pure logic, no Ray calls."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_ACTOR_NAME = re.compile(r"(.+)\.pp(\d+)\.tp(\d+)")


@dataclass(frozen=True, order=True)
class RankId:
    """A rank's coordinates in one engine; its actor name is derived, never counted."""

    engine: str
    pp: int
    tp: int

    @property
    def actor_name(self) -> str:
        return f"{self.engine}.pp{self.pp}.tp{self.tp}"

    @classmethod
    def from_actor_name(cls, name: str) -> "RankId":
        match = _ACTOR_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"not a rank actor name: {name!r} (expected '<engine>.pp<P>.tp<T>')")
        engine, pp, tp = match.groups()
        return cls(engine=engine, pp=int(pp), tp=int(tp))


def cpu_binding_plan(hosts: list[dict[str, Any]], binding: str) -> list[list[int]]:
    """CPUs each rank pins to, in rank order; an empty list means leave it alone.

    ``hosts[r]`` is what rank ``r`` reported: ``{"ip", "cpus"}``. With ``auto``,
    ranks sharing a host IP split that host's CPUs as evenly as they go (a
    rank gets at least one; with more ranks than CPUs they share round-robin).
    Grouped by IP rather than Ray node id because several raylets on one
    machine are several nodes over the same cores.
    """
    if binding == "nobind":
        return [[] for _ in hosts]
    if binding != "auto":
        from vllm.utils.cpu_resource_utils import parse_id_list

        lists = binding.split("|")
        if len(lists) != len(hosts):
            raise ValueError(
                f"cpu_binding {binding!r} gives {len(lists)} CPU lists for {len(hosts)} ranks; "
                "give one per rank separated by '|', or use 'auto' / 'nobind'."
            )
        return [list(parse_id_list(item)) for item in lists]
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host["ip"], []).append(rank)
    plan: list[list[int]] = [[] for _ in hosts]
    for ranks in by_host.values():
        cpus = sorted(set().union(*(hosts[r]["cpus"] for r in ranks)))
        if len(cpus) >= len(ranks):
            # Contiguous slices; the remainder goes one each to the last ranks.
            share, extra = divmod(len(cpus), len(ranks))
            start = 0
            for i, rank in enumerate(ranks):
                size = share + (1 if i >= len(ranks) - extra else 0)
                plan[rank] = cpus[start : start + size]
                start += size
        else:
            for i, rank in enumerate(ranks):
                plan[rank] = [cpus[i % len(cpus)]]
    return plan
