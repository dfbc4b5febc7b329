"""Start and stop a ``ray start --head`` of a test's own, touching no other process on the machine."""

from __future__ import annotations

import os
import signal
import socket
import time


def free_ports(n: int) -> list[int]:
    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _descendants_and_matches(needles: list[str]) -> dict[int, str | None]:
    """PIDs whose command line contains a needle, plus all their descendants, with their start times.

    Read from /proc: ``ps`` cuts command lines at 80 columns when its output
    is not a terminal, which hides the temp dir in a raylet's arguments.
    """
    parent, mine = {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        pid = int(entry)
        parent[pid] = ppid
        if pid != os.getpid() and any(n in command for n in needles):
            mine.add(pid)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if pid not in mine and ppid in mine:
                mine.add(pid)
                grew = True
    return {pid: _start_time(pid) for pid in sorted(mine)}


def stop_processes(needles: list[str]) -> None:
    """End the processes a head node started (matched by its temp dir and GCS port), nothing else."""
    pids = _descendants_and_matches(needles)

    def alive() -> list[int]:  # ours and still running (a reused pid has another start time)
        return [pid for pid, started_at in pids.items() if _start_time(pid) == started_at]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while sig == signal.SIGTERM and time.monotonic() < deadline and alive():
            time.sleep(0.5)


def nnsight_ray_command(*args: str) -> list[str]:
    """``nnsight-ray ARGS`` as users run it: the console script beside this interpreter (``pip install`` puts it
    there), else ``python -m nnsight_ray.cli``, the same command."""
    import shutil
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("nnsight-ray")
    if script.exists() or (script := shutil.which("nnsight-ray")):
        return [str(script), *args]
    return [sys.executable, "-m", "nnsight_ray.cli", *args]


def submit_batch(dashboard: str, config: dict, folder, env: dict, job_env: dict | None = None):
    """Write ``config`` as YAML in ``folder`` and run it through ``nnsight-ray submit`` (``ray job submit``).

    ``job_env``: more variables for the job's runtime env (``--env KEY=VALUE``).
    """
    import subprocess
    from pathlib import Path

    import yaml

    path = Path(folder) / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        nnsight_ray_command("submit", "--address", dashboard, "--no-working-dir", "--config", str(path),
                            "--env", "TOKENIZERS_PARALLELISM=false",
                            *(arg for key, value in (job_env or {}).items() for arg in ("--env", f"{key}={value}"))),
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done
