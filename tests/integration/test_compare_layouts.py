"""``nnsight-ray compare-layouts``, run as users run it, on the session's simulated cluster (four raylets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray

pytestmark = pytest.mark.integration


def our_actors(prefix: str) -> list[str]:
    """Named actors still registered (not dead) whose name starts with ``prefix``."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def test_pp2_matches_the_running_single_rank_deployment_and_says_where_ranks_ran(ray_cluster, ray_tp1, model_dir,
                                                                                 tmp_path):
    """PP=2 on two raylets against the session's TP=1 deployment (``--reference tp1``: one engine start, not two).

    TP layouts against the single-rank run are checked in test_layouts.py."""
    report_path = tmp_path / "report.json"
    pgs_before = {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"}
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "nnsight_ray.cli", "compare-layouts", "--model", model_dir, "--layouts", "1x2", "--strategies", "STRICT_SPREAD",
         "--reference", "tp1",
         "--engine-arg", "dtype=float32", "--engine-arg", "max_model_len=256",
         "--engine-arg", f"kv_cache_memory_bytes={64 << 20}",
         "--prompt", "The quick brown fox", "--prompt", "abc", "--max-tokens", "3", "--repeats", "1",
         "--json", str(report_path)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all layouts match the single-rank run" in done.stdout

    report = json.loads(report_path.read_text())
    assert report["reference"]["status"] == "ran" and report["reference"]["connected"]
    assert "running deployment tp1" in done.stdout
    assert [(e["layout"], e["placement_strategy"]) for e in report["layouts"]] == [("1x2", "STRICT_SPREAD")]
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    for entry in report["layouts"]:
        assert entry["match"] and entry["tokens_equal"], entry
        assert entry["max_rel_err"] < 1e-3
        ranks = [(r["pp_rank"], r["tp_rank"]) for r in entry["ranks"]]
        assert ranks == [(0, 0), (1, 0)]
        # STRICT_SPREAD: each rank on its own raylet, all of them this cluster's
        assert len({r["node_id"] for r in entry["ranks"]}) == 2 and {r["node_id"] for r in entry["ranks"]} <= nodes
        assert all(r["actor_name"] == f"{entry['name']}.pp{r['pp_rank']}.tp{r['tp_rank']}" for r in entry["ranks"])
        assert entry["start_s"] > 0 and entry["trace_s_median"] > 0
        # the printed table names the layout and every rank's node
        assert all(r["actor_name"] in done.stdout for r in entry["ranks"])

    # every engine it started is gone, with its placement group; the reference still serves
    assert ray_tp1.topology()
    assert our_actors("compare-") == []
    pgs_after = {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"}
    assert pgs_after <= pgs_before



@pytest.mark.parametrize("args,needle", [
    (["--layouts", "2y1"], "layout '2y1': expected TPxPP"),
    (["--strategies", "SPREAD,WIDE"], "strategies ['WIDE']: choose from PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
    (["--max-tokens", "0"], "--max-tokens and --local-nodes must be >= 1"),
])
def test_bad_arguments_exit_2_before_anything_starts(args, needle, tmp_path):
    """Checked where they are parsed: no cluster joined or started, no checkpoint built."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "nnsight_ray.cli", "compare-layouts", *args,
                           "--workdir", str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and needle in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.startswith("usage: nnsight-ray compare-layouts") and not (tmp_path / "work").exists()
