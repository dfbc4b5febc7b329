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

Every raylet and the driver bind 127.0.0.1: ``loopback_only()`` sets
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which Ray reads once, when it is first
imported; a driver whose Ray read it unset dials the machine's external
address for a raylet that is not there, for minutes. Entry points that start a
cluster call it before anything imports Ray (``python -m nnsight_ray.batch
--local-cluster N`` before its preflight, which imports vLLM and so Ray);
``LocalCluster`` calls it too, and corrects a Ray imported earlier.

The GCS here declares a lost raylet dead within ``HEALTH_CHECK`` (about 3 s
for a killed raylet, 13 s with Ray's defaults; docs/clusters.md, "A lost
node"), so a deployment that loses a node fails every waiter within 10 s.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

logger = logging.getLogger(__name__)

__all__ = ["LocalCluster", "loopback_only"]

_ATTEMPTS = 3

#: The GCS's raylet health check (Ray 2.60 ``ray_config_def.h``; Ray's defaults:
#: period 3000 ms, timeout 10000 ms, threshold 5, initial delay 5000 ms). The
#: GCS declares a raylet dead after ``threshold`` failed checks in a row, one
#: per period. A killed raylet's port refuses at once, so it is found in about
#: threshold x period: 3 s here (measured 2.9 s by test_node_loss.py), 13 s with
#: the defaults; plus up to the initial delay, kept at Ray's 5 s, for a raylet
#: lost within seconds of joining (not yet hosting ranks). On one machine a
#: raylet never vanishes without closing its port, so the timeout only guards
#: against false positives: a live raylet is declared dead (and exits) only if
#: its gRPC server leaves three checks in a row unanswered for 2 s each and it
#: sends no resource report meanwhile, some 8 s of silence, where a loaded
#: 2-core CI machine delays an answer by milliseconds (docs/clusters.md, "A lost node").
HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 3}


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


def loopback_only() -> None:
    """Keep Ray on 127.0.0.1 in this process and the raylets it starts; call before anything imports Ray.

    Sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` unless it is set, and how long
    a raylet waits for its agents' port files before it aborts
    (``RAY_raylet_start_wait_time_s``, read by the raylet binary; Ray's
    default is too short on a busy machine). Ray reads the first once, at
    import: if it was imported already, its copy is read again from the
    environment, as Ray reads it (``ray._private.ray_constants``).
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        enabled = constants.env_bool(constants.ENABLE_RAY_CLUSTERS_ENV_VAR, not constants.IS_WINDOWS_OR_OSX)
        if enabled != constants.ENABLE_RAY_CLUSTER:
            logger.debug("ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER was set; now %s", enabled)
            constants.ENABLE_RAY_CLUSTER = enabled


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
    """``n`` raylets on 127.0.0.1 (a head and ``n - 1`` nodes), this process joined as the driver.

    ``head_cpus``: the head's CPUs (default ``cpus_per_node``). ``add_node`` and
    ``remove_node`` change the cluster later (a test's dedicated raylet).
    """

    def __init__(self, n: int, cpus_per_node: int = 2, log_to_driver: bool = True,
                 head_cpus: int | None = None) -> None:
        if n < 1:
            raise ValueError(f"--local-cluster {n}: need at least one raylet")
        loopback_only()  # every raylet and this driver bind 127.0.0.1
        import ray

        from .placement import NAMESPACE

        for attempt in range(1, _ATTEMPTS + 1):
            before = _children()
            try:
                self.cluster = self._start(n, cpus_per_node, cpus_per_node if head_cpus is None else head_cpus)
                break
            except Exception as error:
                if "timed out during startup" not in str(error) or attempt == _ATTEMPTS:
                    raise
                logger.warning("a raylet did not register in time (attempt %d of %d); retrying", attempt, _ATTEMPTS)
                self._end(_children() - before)
        ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=log_to_driver)
        self.address = self.cluster.address

    @staticmethod
    def _start(n: int, cpus_per_node: int, head_cpus: int):
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": head_cpus, "node_ip_address": "127.0.0.1", "include_dashboard": False,
                            "_system_config": dict(HEALTH_CHECK), **_ports()},
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

    def add_node(self, num_cpus: int, resources: dict[str, float] | None = None):
        """One more raylet (``ray._private.node.Node``); returned for ``remove_node``. Waits until it registered."""
        node = self.cluster.add_node(num_cpus=num_cpus, resources=resources or {}, node_ip_address="127.0.0.1",
                                     **_ports())
        self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node, allow_graceful: bool = True) -> None:
        """End one raylet's processes; ``allow_graceful=False`` SIGKILLs them, as a lost machine would.

        Its workers (actors) then exit on their own; the GCS learns of the
        loss only from its health checks (``HEALTH_CHECK``), as on a real cluster.
        """
        self.cluster.remove_node(node, allow_graceful=allow_graceful)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
