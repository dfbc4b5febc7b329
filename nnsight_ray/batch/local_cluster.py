"""An embedded Ray cluster of several raylets on 127.0.0.1: the demo's and tests' "nodes".

``ray.cluster_utils.Cluster`` starts a head and extra raylets in this process's
care; each is a real Ray node (own node id, resources, object store), so a
``STRICT_SPREAD`` placement group puts ranks on different nodes as on separate
machines (docs/clusters.md, "The local simulation").

Every raylet gets its own free ports (see ``_ports``). Ray 2.60 still gives a
starting raylet a fixed 30 s to register with the GCS
(``ray._private.node.Node``); on a machine busy with other engines a start can
fail ("The current node timed out during startup"). It is then retried, after
ending the processes the failed attempt started (this process's new
children, by pid), so nothing is left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import time

logger = logging.getLogger(__name__)

__all__ = ["LocalCluster"]

_ATTEMPTS = 3


_PORT_ARGS = ("node_manager_port", "object_manager_port", "dashboard_agent_listen_port", "metrics_agent_port",
              "runtime_env_agent_port", "metrics_export_port")


def _ports() -> dict[str, int]:
    """Free loopback ports for one raylet's services.

    Ray's fixed defaults (52365 for the dashboard agent) collide with other
    clusters on the same machine, and with dynamic ports a raylet waits for
    its agents to write port files, which it abandons after a few seconds on
    a busy machine ("Timed out waiting for file .../metrics_agent_port_...").
    """
    import socket

    sockets = []
    for _ in _PORT_ARGS:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
    ports = {name: sock.getsockname()[1] for name, sock in zip(_PORT_ARGS, sockets)}
    for sock in sockets:
        sock.close()
    return ports


def _children() -> set[int]:
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) == me:
                    found.add(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


class LocalCluster:
    """``n`` raylets on 127.0.0.1 (a head and ``n - 1`` nodes), this process joined as the driver."""

    def __init__(self, n: int, cpus_per_node: int = 2, log_to_driver: bool = True) -> None:
        if n < 1:
            raise ValueError(f"--local-cluster {n}: need at least one raylet")
        # Before Ray is imported: every raylet and this driver bind 127.0.0.1.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # How long a raylet waits for its agents' port files before it aborts
        # (`raylet_start_wait_time_s`, read by the raylet binary; Ray's default
        # is too short on a busy machine).
        os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
        import ray

        from .._internal.options import NAMESPACE

        for attempt in range(1, _ATTEMPTS + 1):
            before = _children()
            try:
                self.cluster = self._start(n, cpus_per_node)
                break
            except Exception as error:
                if "timed out during startup" not in str(error) or attempt == _ATTEMPTS:
                    raise
                logger.warning("a raylet did not register in time (attempt %d of %d); retrying", attempt, _ATTEMPTS)
                self._end(_children() - before)
        ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=log_to_driver)
        self.address = self.cluster.address

    @staticmethod
    def _start(n: int, cpus_per_node: int):
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": cpus_per_node, "node_ip_address": "127.0.0.1", "include_dashboard": False,
                            **_ports()},
        )
        try:
            for _ in range(n - 1):
                cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1", **_ports())
            cluster.wait_for_nodes()
        except BaseException:
            cluster.shutdown()
            raise
        return cluster

    @staticmethod
    def _end(pids: set[int]) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while sig == signal.SIGTERM and time.monotonic() < deadline and any(
                    os.path.exists(f"/proc/{pid}") for pid in pids):
                time.sleep(0.2)
        for pid in pids:  # reap our children
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
