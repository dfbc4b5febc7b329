#!/usr/bin/env bash
# A three-"node" Ray cluster on one machine, every process bound to 127.0.0.1.
#
# Usage:
#   bash cluster_configs/local-multinode.sh [start]   # head + worker "node_a" + worker "node_b"
#   bash cluster_configs/local-multinode.sh status    # `ray status` of this cluster
#   bash cluster_configs/local-multinode.sh stop      # stop this cluster's processes only
#
# Examples (from the repository root, with the project's venv):
#   bash cluster_configs/local-multinode.sh
#   export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_ADDRESS=127.0.0.1:6390
#   ray job submit --address http://127.0.0.1:8265 --working-dir . \
#       -- python -m nnsight_ray.batch --config cluster_configs/batch-demo.yaml
#   serve deploy --address http://127.0.0.1:8265 cluster_configs/serve.yaml
#   bash cluster_configs/local-multinode.sh stop
#
# Each raylet is a separate Ray node with its own node id, CPUs and a custom
# resource naming it ({"node_head": 1}, {"node_a": 1}, {"node_b": 1}), so a
# STRICT_SPREAD placement group of 2 rank bundles lands on two different nodes,
# as it would on two machines. All nodes share this machine's cores and IP:
# code that tells nodes apart must use Ray node ids, not IPs.
#
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every raylet and driver on
# 127.0.0.1 (otherwise Ray rewrites 127.0.0.1 to the machine's interface
# address), so nothing listens on or talks to another address. Drivers that
# join this cluster need it in their environment too, before `ray` is imported.
# The same variable makes `ray start --address=...` refuse to add a worker
# node, so the workers are started through the call `ray start` makes
# (`ray._private.node.Node(params, head=False)`, as ray.cluster_utils does),
# without that CLI guard; the head is a plain `ray start --head`.
#
# `ray stop` would stop every Ray process on the machine, including clusters
# other people started; `stop` here ends only the processes whose command line
# names this cluster (its GCS address or temp dir), and their descendants.
#
# Settings (environment variables, all optional):
#   NNSIGHT_RAY_LOCAL_PORT        GCS port of the head (default 6390); node i also
#                                 takes the fixed ports PORT+10*i+1 .. PORT+10*i+7
#   NNSIGHT_RAY_DASHBOARD_PORT    dashboard / job-submission port (default 8265)
#   NNSIGHT_RAY_HEAD_CPUS         CPUs of the head node (default 1)
#   NNSIGHT_RAY_WORKER_CPUS       CPUs of each worker node (default 2)
#   NNSIGHT_RAY_OBJECT_STORE_MB   object store of each node, MiB (default 512)
#   PYTHON                        the Python with ray installed (default: .venv/bin/python, else python3)

set -euo pipefail

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_USAGE_STATS_ENABLED=0
# Serve's one proxy (serve.yaml: HeadOnly) would otherwise send every request to
# a replica on its own "node"; here every node is this machine.
export RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING=0

PORT="${NNSIGHT_RAY_LOCAL_PORT:-6390}"
DASHBOARD_PORT="${NNSIGHT_RAY_DASHBOARD_PORT:-8265}"
HEAD_CPUS="${NNSIGHT_RAY_HEAD_CPUS:-1}"
WORKER_CPUS="${NNSIGHT_RAY_WORKER_CPUS:-2}"
OBJECT_STORE_BYTES=$(( ${NNSIGHT_RAY_OBJECT_STORE_MB:-512} * 1024 * 1024 ))
ADDRESS="127.0.0.1:${PORT}"
TEMP_DIR="/tmp/nnsight_ray_local_${PORT}"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "${REPO_ROOT}/.venv/bin/python" ]]; then PYTHON="${REPO_ROOT}/.venv/bin/python"; else PYTHON="python3"; fi
fi
# Job entrypoints (`ray job submit -- python ...`) run with the raylets' PATH:
# put this Python first so `python` there is the one with nnsight_ray installed.
PATH="$(dirname "$(command -v "$PYTHON")"):${PATH}"
export PATH
ray_cli() { "$PYTHON" -m ray.scripts.scripts "$@"; }

# PIDs of this cluster's processes: the command line names our GCS address,
# GCS port or temp dir. Then all their descendants (job drivers, engine cores).
cluster_pids() {
    # The patterns travel in the environment, not on awk's command line, so
    # awk does not match itself.
    ps -eo pid=,ppid=,args= | ADDR="${ADDRESS} " GCS="gcs_server_port=${PORT} " TMP="${TEMP_DIR}" SELF="$$" awk '
        {
            pid = $1; parent[pid] = $2; $1 = ""; $2 = ""; cmd = $0 " "
            if (pid != ENVIRON["SELF"] && (index(cmd, ENVIRON["ADDR"]) || index(cmd, ENVIRON["GCS"]) ||
                index(cmd, ENVIRON["TMP"] "/") || index(cmd, ENVIRON["TMP"] " "))) mine[pid] = 1
        }
        END {
            for (grew = 1; grew;) {
                grew = 0
                for (pid in parent) if (!(pid in mine) && (parent[pid] in mine)) { mine[pid] = 1; grew = 1 }
            }
            for (pid in mine) print pid
        }'
}

# The fixed ports of node $1 (0 = head), distinct per node: several raylets on
# one machine must not share them, and Ray's defaults (e.g. 52365 for the
# dashboard agent) would also collide with clusters other people run here.
node_ports() {
    local base=$(( PORT + 10 * $1 ))
    echo "--node-manager-port=$(( base + 1 )) --object-manager-port=$(( base + 2 ))" \
         "--dashboard-agent-listen-port=$(( base + 3 )) --dashboard-agent-grpc-port=$(( base + 4 ))" \
         "--runtime-env-agent-port=$(( base + 5 )) --metrics-export-port=$(( base + 6 ))"
}

# The GCS declares a lost raylet dead after 3 failed health checks, one a
# second (~3 s for a killed raylet; Ray's defaults take ~13 s, over the 10 s in
# which nnsight_ray fails every waiter of a deployment that lost a node). Only
# the GCS reads these; the 2 s timeout is a margin against a starved raylet
# (docs/clusters.md, "A lost node"; the same as nnsight_ray._internal.cluster.local_cluster).
start_head() {
    # shellcheck disable=SC2046  # node_ports is a list of flags
    RAY_health_check_period_ms=1000 RAY_health_check_timeout_ms=2000 RAY_health_check_failure_threshold=3 \
    ray_cli start --head --port="$PORT" --node-ip-address=127.0.0.1 $(node_ports 0) \
        --num-cpus="$HEAD_CPUS" --num-gpus=0 --resources='{"node_head": 1}' \
        --object-store-memory="$OBJECT_STORE_BYTES" --temp-dir="$TEMP_DIR" \
        --ray-client-server-port=$(( PORT + 7 )) --disable-usage-stats \
        --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT"
}

# A worker raylet with the same parameters `ray start --address=$ADDRESS` would
# pass (ray/scripts/scripts.py in Ray 2.60), ports as in node_ports.
start_worker() {  # $1 = node index, $2 = its resource name
    "$PYTHON" - "$ADDRESS" "$2" "$WORKER_CPUS" "$OBJECT_STORE_BYTES" "$TEMP_DIR" $(( PORT + 10 * $1 )) <<'PY'
import sys

import ray._private.node
import ray._private.parameter

address, name, cpus, store, temp_dir, base = sys.argv[1:]
base = int(base)
params = ray._private.parameter.RayParams(
    gcs_address=address,
    node_ip_address="127.0.0.1",
    node_name=name,
    num_cpus=int(cpus),
    num_gpus=0,
    resources={name: 1},
    object_store_memory=int(store),
    temp_dir=temp_dir,
    node_manager_port=base + 1,
    object_manager_port=base + 2,
    dashboard_agent_listen_port=base + 3,
    metrics_agent_port=base + 4,
    runtime_env_agent_port=base + 5,
    metrics_export_port=base + 6,
)
ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
print(f"worker node {name} up on 127.0.0.1: {cpus} CPUs, resources {{'{name}': 1}}")
PY
}

start() {
    if [[ -n "$(cluster_pids)" ]]; then
        echo "a cluster on ${ADDRESS} is already running; run '$0 stop' first" >&2
        exit 1
    fi
    mkdir -p "$TEMP_DIR"
    start_head
    start_worker 1 node_a
    start_worker 2 node_b
    cat <<EOF

Three Ray nodes on ${ADDRESS}: head (${HEAD_CPUS} CPU), node_a and node_b (${WORKER_CPUS} CPUs each).
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_ADDRESS=${ADDRESS}
  jobs, serve deploy: http://127.0.0.1:${DASHBOARD_PORT}
  stop:               bash $0 stop
EOF
}

status() {
    ray_cli status --address="$ADDRESS"
}

stop() {
    local pids
    pids="$(cluster_pids)"
    if [[ -z "$pids" ]]; then
        echo "no cluster running on ${ADDRESS}"
        return 0
    fi
    # shellcheck disable=SC2086  # one PID per word
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 1 20); do
        pids="$(cluster_pids)"
        [[ -z "$pids" ]] && break
        sleep 0.5
    done
    if [[ -n "$pids" ]]; then
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
    fi
    rm -rf "$TEMP_DIR"
    echo "stopped the cluster on ${ADDRESS}"
}

case "${1:-start}" in
    start) start ;;
    status) status ;;
    stop) stop ;;
    -h | --help | help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//' ;;
    *) echo "unknown command '$1'; use start, status or stop" >&2; exit 2 ;;
esac
