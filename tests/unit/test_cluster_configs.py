"""``cluster_configs/``: every file parses and carries what its tool requires.

The configs are only ever consumed by other tools (``ray up``, the KubeRay
operator, ``serve deploy``, ``python -m nnsight_ray.batch``), so a typo would
surface on someone's cluster, minutes into a launch. These tests check each file
against the schema its tool documents, offline:

- the cluster launcher YAML against Ray's own ``ray/autoscaler/ray-schema.json``
  (the JSON schema ``ray up`` validates with), and through Ray's
  ``prepare_config`` + ``validate_config`` (what ``ray up`` runs on it);
- the KubeRay manifests against the required fields of KubeRay's CRDs and the
  operator's own validation (``ray-operator/config/crd/bases/ray.io_*.yaml`` and
  ``ray-operator/controllers/ray/utils/validation.go``, KubeRay v1.7). With
  ``KUBERAY_CRD_DIR`` pointing at a folder holding those three CRD files, each
  manifest is also validated against the full ``openAPIV3Schema``;
- every Serve config (``serve.yaml`` and the RayService's ``serveConfigV2``)
  with Ray Serve's ``ServeDeploySchema``;
- the batch run configs with ``nnsight_ray.batch.config.load_config`` (skipped
  until that module exists) and, meanwhile, against the keys it documents.

No test here starts or joins Ray: ``ray.init`` raises.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "cluster_configs"
YAML_FILES = sorted(CONFIGS.glob("*.yaml"))

LAUNCHER = CONFIGS / "ray-cluster-gpu.yaml"
RAYCLUSTER = CONFIGS / "kuberay-raycluster.yaml"
RAYJOB = CONFIGS / "kuberay-rayjob.yaml"
RAYSERVICE = CONFIGS / "kuberay-rayservice.yaml"
SERVE = CONFIGS / "serve.yaml"
BATCH_DEMO = CONFIGS / "batch-demo.yaml"
LOCAL_SCRIPT = CONFIGS / "local-multinode.sh"

BUILD_APP = "nnsight_ray.serve:build_app"
DEPLOYMENT = "NNsightDeployment"
BATCH_ENTRYPOINT = "python -m nnsight_ray.batch --config /config/run.yaml"
# build_app's documented arguments.
SERVE_ARGS = {"model", "tensor_parallel_size", "pipeline_parallel_size", "placement_strategy", "api_key",
              "max_body_bytes", "engine_kwargs", "served_names", "result_ttl_s"}
# The batch config's documented schema (top level and sections).
BATCH_KEYS = {"model", "engine", "prompts", "saves", "intervention", "sampling", "output"}
BATCH_SECTIONS = {
    "model": {"path", "build_arch"},
    "engine": {"tensor_parallel_size", "pipeline_parallel_size", "placement_strategy", "cpus_per_rank",
               "gpus_per_rank", "replicas", "engine_kwargs"},
    "prompts": {"path", "id_field", "text_field"},
    "sampling": {"max_tokens", "temperature"},
    "output": {"dir", "shard_size"},
}


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def load_one(path: Path) -> dict[str, Any]:
    (doc,) = load_docs(path)
    return doc


def by_kind(path: Path, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in load_docs(path) if d.get("kind") == kind]
    return doc


# --------------------------------------------------------------------------- all files


def test_the_documented_files_exist():
    names = {p.name for p in CONFIGS.iterdir()}
    expected = {LAUNCHER, RAYCLUSTER, RAYJOB, RAYSERVICE, SERVE, BATCH_DEMO, LOCAL_SCRIPT}
    assert {p.name for p in expected} <= names
    assert (CONFIGS / "README.md").exists()


def test_readme_has_a_line_for_every_file():
    readme = (CONFIGS / "README.md").read_text()
    for path in CONFIGS.iterdir():
        if path.name != "README.md":
            assert f"`{path.name}`" in readme, f"cluster_configs/README.md does not mention {path.name}"


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_every_yaml_parses_to_mappings(path):
    docs = load_docs(path)
    assert docs, f"{path.name} is empty"
    assert all(isinstance(d, dict) for d in docs)


# A mapping key at the start of a line (optionally a list item's first key).
_KEY_LINE = re.compile(r"""^(\s*)(?:-\s+)?(?:[A-Za-z_][\w.\-/]*|"[^"]*"|'[^']*')\s*:(?:\s|$)""")


def uncommented_keys(text: str) -> list[str]:
    """Key lines with neither an inline comment nor a comment line right above."""
    missing, previous = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if _KEY_LINE.match(line) and " #" not in line and not previous.startswith("#"):
            missing.append(f"{number}: {stripped}")
        previous = stripped
    return missing


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_every_key_has_a_comment(path):
    """House style: configs document themselves (also inside embedded YAML strings)."""
    assert uncommented_keys(path.read_text()) == []


def test_the_comment_check_catches_a_bare_key():
    assert uncommented_keys("# about a\na: 1\nb: 2  # about b\nc: 3\n") == ["4: c: 3"]


# --------------------------------------------------------------------------- cluster launcher


def launcher_schema() -> dict[str, Any]:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_launcher_validates_against_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(load_one(LAUNCHER), launcher_schema())


def test_launcher_schema_check_rejects_an_unknown_key():
    jsonschema = pytest.importorskip("jsonschema")
    config = load_one(LAUNCHER)
    config["head_node_typo"] = "head.cpu"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, launcher_schema())


def test_launcher_passes_what_ray_up_runs_on_it():
    """``ray up`` fills in the provider's defaults, then validates the result."""
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(load_one(LAUNCHER)))


def test_launcher_has_a_head_without_gpu_and_gpu_workers():
    config = load_one(LAUNCHER)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert head["resources"].get("CPU") == 0, "the head should take no CPU work (engine drivers belong on GPU nodes)"
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers.values())
    assert sum(t.get("min_workers", 0) for t in workers.values()) <= config["max_workers"]
    assert sum(t.get("max_workers", 0) for t in workers.values()) <= config["max_workers"]


def test_launcher_installs_nnsight_ray_gpu_on_the_pinned_ray():
    import ray

    config = load_one(LAUNCHER)
    assert any("nnsight_ray[gpu]" in command for command in config["setup_commands"])
    assert f"rayproject/ray:{ray.__version__}-py311" in config["docker"]["image"]
    local, = [local for remote, local in config["file_mounts"].items() if "nnsight_ray" in remote]
    assert local == "."


def test_launcher_commands_are_valid_bash():
    config = load_one(LAUNCHER)
    keys = ["initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands"]
    for command in (c for key in keys for c in config.get(key, [])):
        result = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert result.returncode == 0, f"{command!r}: {result.stderr}"


def test_launcher_dashboard_stays_on_loopback_and_nodes_export_network_env():
    config = load_one(LAUNCHER)
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = " ".join(config[key])
        for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "VLLM_HOST_IP"):
            assert var in start, f"{key} should export {var} before `ray start`"


# --------------------------------------------------------------------------- KubeRay


def check_cluster_spec(spec: dict[str, Any], where: str) -> None:
    """RayClusterSpec: the CRD's required fields and the operator's validation rules."""
    import ray

    assert "headGroupSpec" in spec, f"{where}: headGroupSpec is required"
    assert spec.get("rayVersion") == ray.__version__, f"{where}: rayVersion should be the pinned Ray"
    groups = [("head", spec["headGroupSpec"])] + [(g.get("groupName"), g) for g in spec.get("workerGroupSpecs", [])]
    assert len(groups) > 1, f"{where}: no worker group"
    images = set()
    for name, group in groups:
        assert "template" in group, f"{where}/{name}: template is required"
        containers = group["template"]["spec"]["containers"]
        assert containers and all("name" in c and "image" in c for c in containers), f"{where}/{name}"
        images.add(containers[0]["image"])
        params = group.get("rayStartParams", {})
        assert all(isinstance(v, str) for v in params.values()), f"{where}/{name}: rayStartParams values are strings"
        assert not (params.keys() & {"num-cpus", "num-gpus", "memory", "resources"} and group.get("resources")), (
            f"{where}/{name}: resources in both rayStartParams and the group's resources field"
        )
        for volume_mount in (m for c in containers for m in c.get("volumeMounts", [])):
            volumes = {v["name"] for v in group["template"]["spec"].get("volumes", [])}
            assert volume_mount["name"] in volumes, f"{where}/{name}: mount of unknown volume {volume_mount['name']}"
    assert len(images) == 1, f"{where}: head and workers should run one image"

    head = spec["headGroupSpec"]
    assert head.get("rayStartParams", {}).get("num-cpus") == "0", f"{where}: the head should advertise no CPU"
    head_limits = head["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    assert "nvidia.com/gpu" not in head_limits, f"{where}: the head has no GPU"

    autoscaling = spec.get("enableInTreeAutoscaling", False)
    for group in spec["workerGroupSpecs"]:
        assert {"groupName", "maxReplicas", "minReplicas", "template"} <= group.keys(), f"{where}: worker group fields"
        if not autoscaling:
            assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1, f"{where}/{group['groupName']}: GPU workers"


def test_raycluster_has_the_required_fields():
    doc = load_one(RAYCLUSTER)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster" and doc["metadata"]["name"]
    check_cluster_spec(doc["spec"], "RayCluster")


def test_rayjob_has_the_required_fields():
    doc = by_kind(RAYJOB, "RayJob")
    assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"]
    spec = doc["spec"]
    assert spec["entrypoint"] == BATCH_ENTRYPOINT
    assert "rayClusterSpec" in spec or "clusterSelector" in spec, "one of rayClusterSpec or clusterSelector"
    check_cluster_spec(spec["rayClusterSpec"], "RayJob.rayClusterSpec")
    assert spec.get("entrypointNumCpus", 0) > 0, "the driver belongs on a GPU worker, not the CPU-less head"
    assert spec.get("ttlSecondsAfterFinished", 0) >= 0 and spec.get("activeDeadlineSeconds", 1) > 0


def pod_volume(group: dict[str, Any], name: str) -> tuple[dict, dict]:
    """A group's volume called ``name`` and its mount in the Ray container."""
    pod = group["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == name]
    return volume, mount


def test_rayjob_mounts_its_configmap_at_config_and_its_pvc_everywhere():
    spec = by_kind(RAYJOB, "RayJob")["spec"]
    configmap = by_kind(RAYJOB, "ConfigMap")
    pvc = by_kind(RAYJOB, "PersistentVolumeClaim")
    assert "run.yaml" in configmap["data"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "the driver may run on any pod"
    cluster = spec["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        volume, mount = pod_volume(group, "batch-config")
        assert volume["configMap"]["name"] == configmap["metadata"]["name"]
        assert mount["mountPath"] == "/config"
        volume, mount = pod_volume(group, "runs")
        assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        run = yaml.safe_load(configmap["data"]["run.yaml"])
        assert run["output"]["dir"].startswith(mount["mountPath"] + "/")


def test_rayjob_prompts_are_in_the_configmap():
    configmap = by_kind(RAYJOB, "ConfigMap")
    run = yaml.safe_load(configmap["data"]["run.yaml"])
    assert run["prompts"]["path"].startswith("/config/")
    name = run["prompts"]["path"].removeprefix("/config/")
    rows = [json.loads(line) for line in configmap["data"][name].splitlines()]
    assert rows and all({run["prompts"]["id_field"], run["prompts"]["text_field"]} <= row.keys() for row in rows)


def test_rayservice_has_the_required_fields():
    doc = load_one(RAYSERVICE)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService" and doc["metadata"]["name"]
    assert "rayClusterConfig" in doc["spec"] and isinstance(doc["spec"]["serveConfigV2"], str)
    check_cluster_spec(doc["spec"]["rayClusterConfig"], "RayService.rayClusterConfig")
    head_svc = doc["spec"]["rayClusterConfig"]["headGroupSpec"].get("headService", {})
    assert not head_svc.get("metadata", {}).get("name"), "KubeRay refuses a named head Service in a RayService"


def test_rayservice_api_key_reaches_every_pod():
    spec = load_one(RAYSERVICE)["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert "secretKeyRef" in env["NNSIGHT_RAY_API_KEY"]["valueFrom"]


@pytest.mark.parametrize(
    "path,kind,crd",
    [(RAYCLUSTER, "RayCluster", "ray.io_rayclusters.yaml"), (RAYJOB, "RayJob", "ray.io_rayjobs.yaml"),
     (RAYSERVICE, "RayService", "ray.io_rayservices.yaml")],
    ids=["RayCluster", "RayJob", "RayService"],
)
def test_kuberay_manifest_validates_against_the_crd(path, kind, crd):
    """Full openAPIV3Schema validation, when the CRDs are at hand (KUBERAY_CRD_DIR)."""
    jsonschema = pytest.importorskip("jsonschema")
    folder = os.environ.get("KUBERAY_CRD_DIR")
    if not folder or not (Path(folder) / crd).exists():
        pytest.skip(f"set KUBERAY_CRD_DIR to a folder with KubeRay's {crd} (ray-operator/config/crd/bases)")
    definition = yaml.safe_load((Path(folder) / crd).read_text())
    (version,) = [v for v in definition["spec"]["versions"] if v["name"] == "v1"]
    validator = jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(by_kind(path, kind))]
    assert errors == []


def test_kuberay_network_env_is_set_per_pod():
    for path, kind, key in [(RAYCLUSTER, "RayCluster", None), (RAYJOB, "RayJob", "rayClusterSpec"),
                            (RAYSERVICE, "RayService", "rayClusterConfig")]:
        spec = by_kind(path, kind)["spec"]
        spec = spec[key] if key else spec
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            env = {e["name"]: e for e in group["template"]["spec"]["containers"][0].get("env", [])}
            assert env["VLLM_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", path.name
            assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= env.keys(), path.name


# --------------------------------------------------------------------------- Serve


def serve_configs() -> list[tuple[str, dict[str, Any]]]:
    service = load_one(RAYSERVICE)
    return [("serve.yaml", load_one(SERVE)), ("serveConfigV2", yaml.safe_load(service["spec"]["serveConfigV2"]))]


@pytest.mark.parametrize("name,config", serve_configs(), ids=["serve.yaml", "serveConfigV2"])
def test_serve_config_validates_with_serves_schema(name, config):
    from ray.serve.schema import ServeDeploySchema

    from nnsight_ray._internal.cluster.placement import RankPlacement

    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == BUILD_APP
    assert app.route_prefix == "/"
    assert [d.name for d in app.deployments] == [DEPLOYMENT]
    assert app.deployments[0].num_replicas == 1
    assert set(app.args) <= SERVE_ARGS, f"{name}: unknown build_app arguments {set(app.args) - SERVE_ARGS}"
    assert {"model", "tensor_parallel_size", "pipeline_parallel_size"} <= set(app.args)
    RankPlacement(placement_strategy=app.args["placement_strategy"])
    assert "api_key" not in app.args, f"{name}: keep the key out of the config (NNSIGHT_RAY_API_KEY)"


def test_local_serve_config_binds_loopback():
    config = load_one(SERVE)
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000}
    assert config["proxy_location"] in {"EveryNode", "HeadOnly", "Disabled"}


# --------------------------------------------------------------------------- batch


def batch_configs(tmp_path: Path) -> list[Path]:
    """batch-demo.yaml, and the RayJob's run.yaml with its /config mount materialized in tmp_path."""
    configmap = by_kind(RAYJOB, "ConfigMap")
    mount = tmp_path / "config"
    mount.mkdir()
    for name, content in configmap["data"].items():
        (mount / name).write_text(content)
    run = mount / "run.yaml"
    run.write_text(configmap["data"]["run.yaml"].replace("/config/", f"{mount}/"))
    return [BATCH_DEMO, run]


def test_batch_configs_use_the_documented_keys(tmp_path):
    from nnsight_ray._internal.cluster.placement import RankPlacement

    for path in batch_configs(tmp_path):
        config = yaml.safe_load(path.read_text())
        assert set(config) <= BATCH_KEYS, f"{path.name}: unknown keys {set(config) - BATCH_KEYS}"
        assert ("saves" in config) != bool(config.get("intervention")), f"{path.name}: saves or intervention"
        for section, keys in BATCH_SECTIONS.items():
            assert set(config.get(section, {})) <= keys, f"{path.name}/{section}: {set(config[section]) - keys}"
        assert all(s["tokens"] in {"last", "all"} for s in config["saves"])
        engine = config["engine"]
        RankPlacement(**{k: engine[k] for k in ("placement_strategy", "cpus_per_rank", "gpus_per_rank")})
        assert Path(config["prompts"]["path"]).suffix in {".jsonl", ".txt", ".parquet"}


def test_batch_demo_runs_tp2_saving_every_layer_and_the_logits():
    config = load_one(BATCH_DEMO)
    assert config["engine"]["tensor_parallel_size"] == 2
    assert config["model"]["build_arch"] == "llama"
    locations = {s["location"]: s["tokens"] for s in config["saves"]}
    assert locations == {**{f"model.layers.{i}.output": "last" for i in range(4)}, "logits": "last"}


def test_batch_configs_load_with_the_batch_loader(tmp_path, monkeypatch):
    config_module = pytest.importorskip("nnsight_ray.batch.config")
    monkeypatch.chdir(ROOT)  # relative paths are the job's working dir: the repository root
    for path in batch_configs(tmp_path):
        config_module.load_config(path)


# --------------------------------------------------------------------------- local simulation


def test_local_multinode_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(LOCAL_SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_local_multinode_script_shape():
    text = LOCAL_SCRIPT.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("#!") and lines[1].startswith("#") and "Usage" in text.split("\n\n")[0]
    code = [line for line in lines if not line.lstrip().startswith("#")]
    first_ray = next(i for i, line in enumerate(code) if re.search(r"ray_cli|ray\._private|\bray start", line))
    export = next(i for i, line in enumerate(code) if line.startswith("export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"))
    assert export < first_ray, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 must be exported before Ray runs"
    body = "\n".join(code)
    for needle in ("--head", "--node-ip-address=127.0.0.1", "--disable-usage-stats", "--dashboard-host=127.0.0.1",
                   '"node_head": 1', "node_a", "node_b", "--num-cpus", "stop)"):
        assert needle in body, needle
    assert not re.search(r"\bray(_cli)?\s+stop\b", body), "`ray stop` would stop other people's clusters too"


def test_local_multinode_script_help_runs_without_ray():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    result = subprocess.run(["bash", str(LOCAL_SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "Usage" in result.stdout


# --------------------------------------------------------------------------- docs


def test_docs_page_covers_configs_env_and_pitfalls():
    text = (ROOT / "docs" / "clusters.md").read_text()
    for path in [LAUNCHER, RAYCLUSTER, RAYJOB, RAYSERVICE, SERVE, BATCH_DEMO, LOCAL_SCRIPT]:
        assert path.name in text, path.name
    for needle in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "VLLM_HOST_IP", "ray://", "placement_timeout_s"):
        assert needle in text, needle


# --------------------------------------------------------------------------- a lost node

# The GCS health check every head here starts with (docs/clusters.md, "A lost node"):
# a lost node is declared dead in ~3 s, not Ray's 13-65 s.
REAL_HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                     "health_check_failure_threshold": 3}


def env_settings(text: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"RAY_(health_check_\w+)=(\d+)", text)}


def test_every_head_starts_its_gcs_with_the_node_loss_health_check():
    from ray._raylet import Config

    from nnsight_ray._internal.cluster.local_cluster import HEALTH_CHECK

    for name in {*REAL_HEALTH_CHECK, *HEALTH_CHECK}:
        assert hasattr(Config, name), f"{name} is not a Ray setting"
    assert HEALTH_CHECK.keys() == REAL_HEALTH_CHECK.keys()
    assert env_settings(LOCAL_SCRIPT.read_text()) == HEALTH_CHECK, "local-multinode.sh: as LocalCluster"
    launcher = load_one(LAUNCHER)
    assert env_settings(" ".join(launcher["head_start_ray_commands"])) == REAL_HEALTH_CHECK
    assert not env_settings(" ".join(launcher["worker_start_ray_commands"])), "only the GCS reads them"
    for path, kind, key in [(RAYCLUSTER, "RayCluster", None), (RAYJOB, "RayJob", "rayClusterSpec"),
                            (RAYSERVICE, "RayService", "rayClusterConfig")]:
        spec = by_kind(path, kind)["spec"]
        spec = spec[key] if key else spec
        env = {e["name"]: e.get("value") for e in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
        assert {k[4:]: int(v) for k, v in env.items() if k.startswith("RAY_health_check")} == REAL_HEALTH_CHECK, \
            path.name
    docs = (ROOT / "docs" / "clusters.md").read_text()
    assert all(name in docs for name in REAL_HEALTH_CHECK) and "## A lost node" in docs
