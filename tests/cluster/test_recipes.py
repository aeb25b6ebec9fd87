"""Cluster recipes in cluster/recipes/: they parse and carry image, resources, entrypoint, metrics port.

The `ray up` YAML is also validated against Ray's own cluster-config schema; the RayJob's
entrypoint is parsed with the sweep's own argument parser and its suite is loaded.
"""

import re
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "cluster" / "recipes"
METRICS_PORT = 8080


def _ray_version() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"ray(\[.*\])?==", d)]
    return pin.split("==")[1]


def _docs(name: str) -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((RECIPES / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def _pod_templates(ray_cluster_spec: dict) -> list[tuple[str, dict, dict]]:
    """(group, rayStartParams, pod template) of the head and every worker group."""
    out = [("head", ray_cluster_spec["headGroupSpec"]["rayStartParams"], ray_cluster_spec["headGroupSpec"]["template"])]
    for group in ray_cluster_spec["workerGroupSpecs"]:
        out.append((group["groupName"], group["rayStartParams"], group["template"]))
    return out


# -- ray up -------------------------------------------------------------------------------
def test_ray_up_recipe_is_a_valid_cluster_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((RECIPES / "ray-up-gpu.yaml").read_text())
    # what `ray up` does first: fill in the provider's defaults, then check against Ray's
    # ray-schema.json (raises on an unknown or mistyped field)
    validate_config(prepare_config(config))
    assert config["docker"]["image"] == f"rayproject/ray:{_ray_version()}-py311-gpu"


def test_ray_up_nodes_export_metrics_and_workers_have_gpus():
    config = yaml.safe_load((RECIPES / "ray-up-gpu.yaml").read_text())
    head = " ".join(config["head_start_ray_commands"])
    workers = " ".join(config["worker_start_ray_commands"])
    assert "ray start --head" in head and f"--metrics-export-port={METRICS_PORT}" in head
    assert "ray start --address=$RAY_HEAD_IP:6379" in workers and f"--metrics-export-port={METRICS_PORT}" in workers
    gpu_types = [t for t in config["available_node_types"].values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu_types and all(t["max_workers"] >= t["min_workers"] >= 1 for t in gpu_types)
    assert config["head_node_type"] in config["available_node_types"]
    # the project is installed on every node, without .git, results or the virtual environment
    assert "/home/ray/scissorhands-bench" in config["file_mounts"]
    assert any("pip install" in c and "/home/ray/scissorhands-bench" in c for c in config["setup_commands"])
    assert {"**/.git", ".venv", "results"} <= set(config["rsync_exclude"])


# -- KubeRay ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, kind", [("kuberay-raycluster.yaml", "RayCluster"), ("kuberay-rayjob.yaml", "RayJob")])
def test_kuberay_pods_carry_image_resources_and_metrics_port(name, kind):
    docs = _docs(name)
    obj = docs[kind]
    assert obj["apiVersion"] == "ray.io/v1"
    spec = obj["spec"] if kind == "RayCluster" else obj["spec"]["rayClusterSpec"]
    assert spec["rayVersion"] == _ray_version()
    images = set()
    for group, params, template in _pod_templates(spec):
        assert params["metrics-export-port"] == str(METRICS_PORT), group
        (container,) = template["spec"]["containers"]
        images.add(container["image"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == METRICS_PORT, group
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)
        limits = container["resources"]["limits"]
        assert limits["cpu"] and limits["memory"], group
        if group != "head":
            assert int(limits["nvidia.com/gpu"]) >= 1, group
            assert container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["results"] == "/mnt/results", group
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in template["spec"]["volumes"]}
        assert claims["results"] == "scissorhands-results"
    assert images == {"scissorhands-bench:0.1.0-gpu"}  # one image, built by cluster/recipes/Dockerfile
    # Prometheus Operator scrapes the pods: the PodMonitor selects their labels and names their port
    monitor = docs["PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    for _, _, template in _pod_templates(spec):
        assert selector.items() <= template["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_raycluster_recipe_has_a_shared_results_volume():
    pvc = _docs("kuberay-raycluster.yaml")["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == "scissorhands-results"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod writes the same folder


def test_rayjob_entrypoint_runs_a_real_suite_into_the_shared_volume():
    from workloads.kinds import load_suite
    from workloads.sweep import parse_args

    job = _docs("kuberay-rayjob.yaml")["RayJob"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "workloads.sweep"]
    args = parse_args(argv[3:])  # the sweep's own flags
    assert load_suite(str(REPO / args.suite)).name == "smoke"
    assert args.results_dir == "/mnt/results" and args.run_id
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["backoffLimit"] == 0
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"  # multi-node: never the loopback-only "0"


def test_dockerfile_builds_on_the_pinned_ray_image():
    text = (RECIPES / "Dockerfile").read_text()
    assert re.search(rf"^FROM rayproject/ray:{re.escape(_ray_version())}-py311-gpu$", text, re.M)
    assert "pip install --no-cache-dir -e ." in text
    assert not re.search(r"^ENV .*RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", text, re.M)
