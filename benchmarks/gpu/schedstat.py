"""``--schedstat N``: which threads ran, and which waited for a core, during each row's turns.

The kernel keeps, per thread, the nanoseconds it ran on a core and the nanoseconds it sat runnable
waiting for one (``/proc/PID/task/TID/schedstat``). Read for every thread of the host before a turn's go
and after its done, the difference is that turn's work, whoever did it: the row's own processes (the
child and everything it started: vLLM's engine core, Ray's daemons and actors), the other rows' (idle
between their turns), and the rest of the host. Summed over a row's turns, the table names what ran
beside the row's model and how long the model's thread waited for a core."""

from __future__ import annotations

import os
from collections import defaultdict

Thread = tuple[str, str, int, int]  # (process title, thread name, ns on a core, ns runnable and waiting)


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, title: the command line's first word, Ray's and vLLM's process titles included)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = _read(f"/proc/{name}/stat")
            parent = int(stat[stat.rindex(")") + 2:].split()[1])
            words = _read(f"/proc/{name}/cmdline").split("\0")
            title = words[0] if words[0] else stat[stat.index("(") + 1:stat.rindex(")")]
            if os.path.basename(title).startswith("python") and len(words) > 2:  # python -m x, python -c ...
                title = f"{os.path.basename(title)} {words[1]} {words[2][:40]}"
            found[int(name)] = (parent, " ".join(title.split())[:60])
        except (OSError, ValueError, IndexError):
            continue
    return found


def snapshot() -> tuple[dict[tuple[int, int], Thread], dict[int, tuple[int, str]]]:
    """Every thread of the host: (pid, tid) -> its title, name and schedstat counters; and the processes."""
    procs, threads = processes(), {}
    for pid, (_, title) in procs.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                ran, waited, _ = _read(f"/proc/{pid}/task/{tid}/schedstat").split()
                threads[(pid, int(tid))] = (title, _read(f"/proc/{pid}/task/{tid}/comm").strip(), int(ran),
                                            int(waited))
            except (OSError, ValueError):
                continue
    return threads, procs


def owner(pid: int, procs: dict[int, tuple[int, str]], roots: dict[int, str]) -> str:
    """The row whose child process ``pid`` descends from ("host" for none)."""
    seen = 0
    while pid > 1 and seen < 64:
        if pid in roots:
            return roots[pid]
        pid, seen = procs.get(pid, (0, ""))[0], seen + 1
    return "host"


class Schedstat:
    """Per row and workload: the turns' thread times, summed by (whose, process title, thread name)."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[tuple[str, str, str], list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self.turns: dict[str, int] = defaultdict(int)
        self.before: dict[tuple[int, int], Thread] = {}

    def begin(self) -> None:
        self.before = snapshot()[0]

    def end(self, tag: str, roots: dict[int, str], workload: str = "") -> None:
        """After ``tag``'s turn (a run of ``workload``): add every thread's times since ``begin`` to the row's."""
        after, procs = snapshot()
        key = f"{tag} {workload}".strip()
        row = self.rows[key]
        self.turns[key] += 1
        for thread, (title, name, ran, waited) in after.items():
            was = self.before.get(thread)
            ran0, waited0 = (was[2], was[3]) if was else (0, 0)
            if ran - ran0 <= 0 and waited - waited0 <= 0:
                continue
            whose = owner(thread[0], procs, roots)
            whose = "own" if whose == tag else whose
            counts = row[(whose, title, name)]
            counts[0] += ran - ran0
            counts[1] += waited - waited0

    def report(self, names: dict[str, str], top: int) -> str:
        """Per row and workload: the threads that ran most in its turns, per turn (``names``: tag -> row name)."""
        lines = []
        for key, row in self.rows.items():
            tag, _, workload = key.partition(" ")
            turns = max(self.turns[key], 1)
            total = sum(c[0] for c in row.values())
            own = sum(c[0] for (whose, *_), c in row.items() if whose == "own")
            lines.append(f"\n[schedstat] {names.get(tag, tag)} {workload}: {turns} turns; per turn, ms on a core: "
                         f"all threads {total / turns / 1e6:,.0f}, the row's own {own / turns / 1e6:,.0f}; top {top} "
                         f"(whose, process, thread: ms ran, ms waited for a core, per turn)")
            for (whose, title, name), (ran, waited) in sorted(row.items(), key=lambda kv: -kv[1][0])[:top]:
                whose = names.get(whose, whose)
                lines.append(f"  {ran / turns / 1e6:>8,.1f} {waited / turns / 1e6:>8,.1f}  {whose:<22.22} "
                             f"{title:<48.48} {name}")
        return "\n".join(lines)
