"""The KubeRay RayService manifest (configs/kuberay/): its embedded Serve config is the GPU
config the project ships (configs/flash-rank-1gpu.yaml, but for the proxies' host), valid as
ServeArgs and as Ray's ServeDeploySchema (what KubeRay puts to the dashboard's Serve API);
its cluster follows the RayService CRD (KubeRay v1.6-v1.7 ``ray.io/v1``: the field names
below, string-valued rayStartParams) and holds the application: every rank on a GPU pod,
the Ingress and the Router beside them, the Serve ports on the head's serve Service."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.serve_args import ServeArgs

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "configs" / "kuberay" / "flash-rank-1gpu.rayservice.yaml"
SERVE_CONFIG = ROOT / "configs" / "flash-rank-1gpu.yaml"

# Field names of the ray.io/v1 RayService CRD (ray-operator/config/crd/bases/
# ray.io_rayservices.yaml, KubeRay v1.6.0 and v1.7.0) at the levels the manifest writes.
RAYSERVICE_SPEC = {"deploymentUnhealthySecondThreshold", "excludeHeadPodFromServeSvc",
                   "managedBy", "rayClusterConfig", "rayClusterDeletionDelaySeconds",
                   "serveConfigV2", "serveService", "serviceUnhealthySecondThreshold",
                   "suspend", "upgradeStrategy"}  # fmt: skip
RAYCLUSTER_SPEC = {"authOptions", "autoscalerOptions", "enableInTreeAutoscaling",
                   "gcsFaultToleranceOptions", "headGroupSpec", "headServiceAnnotations",
                   "historyServerOptions", "managedBy", "networkPolicy", "rayVersion", "suspend",
                   "tlsOptions", "upgradeStrategy", "workerGroupSpecs"}  # fmt: skip
HEAD_GROUP = {"enableIngress", "headService", "ingressOptions", "labels", "rayStartParams",
              "resources", "serviceType", "template"}  # fmt: skip
WORKER_GROUP = {"groupName", "idleTimeoutSeconds", "labels", "maxReplicas", "minReplicas",
                "numOfHosts", "priority", "rayStartParams", "replicas", "resources",
                "scaleStrategy", "suspend", "template"}  # fmt: skip
WORKER_REQUIRED = {"groupName", "maxReplicas", "minReplicas", "template"}
GPU = "nvidia.com/gpu"
ROUTER_CPUS = 0.05  # app.deployments.router's ray_actor_options


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return yaml.safe_load(MANIFEST.read_text())


@pytest.fixture(scope="module")
def serve_config(manifest) -> dict[str, Any]:
    text = manifest["spec"]["serveConfigV2"]
    assert isinstance(text, str)  # the CRD's serveConfigV2 is a YAML string
    return yaml.safe_load(text)


def test_embedded_serve_config_is_the_gpu_config(serve_config):
    shipped = yaml.safe_load(SERVE_CONFIG.read_text())
    assert serve_config["applications"] == shipped["applications"]
    assert serve_config["grpc_options"] == shipped["grpc_options"]
    assert serve_config["proxy_location"] == shipped["proxy_location"]
    # pods are reached on their own addresses: the proxies listen on every interface
    assert serve_config["http_options"] == {**shipped["http_options"], "host": "0.0.0.0"}
    assert set(serve_config) == set(shipped)


def test_embedded_serve_config_validates(serve_config):
    schema = pytest.importorskip("ray.serve.schema")
    schema.ServeDeploySchema.model_validate(serve_config)  # Ray's own check of the PUT body
    for app in serve_config["applications"]:
        assert app["import_path"] == "app.builder:build_app"
        ServeArgs.model_validate(app["args"])


def _container(group: dict[str, Any]) -> dict[str, Any]:
    (container,) = group["template"]["spec"]["containers"]
    return container


def _quantity(q: str | int) -> float:
    """A Kubernetes CPU or count quantity ("4", "500m", 2) as a number."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", str(q))
    assert m, f"unexpected quantity {q!r}"
    return float(m.group(1)) / (1000 if m.group(2) else 1)


def _ray_resources(group: dict[str, Any]) -> dict[str, float]:
    """The logical CPUs and GPUs a group's Ray node offers: rayStartParams where set, else
    the container's limits (as KubeRay derives them); the two must agree where both are."""
    limits = _container(group)["resources"]["limits"]
    params = group["rayStartParams"]
    out = {"CPU": _quantity(params.get("num-cpus", limits["cpu"])),
           "GPU": _quantity(params.get("num-gpus", limits.get(GPU, 0)))}  # fmt: skip
    assert out["CPU"] <= _quantity(limits["cpu"])
    assert out["GPU"] == _quantity(limits.get(GPU, 0)), "num-gpus != the container's GPUs"
    return out


def test_manifest_follows_the_rayservice_crd(manifest):
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert manifest["metadata"]["name"]
    spec = manifest["spec"]
    assert set(spec) <= RAYSERVICE_SPEC and "rayClusterConfig" in spec
    cluster = spec["rayClusterConfig"]
    assert set(cluster) <= RAYCLUSTER_SPEC and "headGroupSpec" in cluster
    head, workers = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert set(head) <= HEAD_GROUP and "template" in head
    for group in [head, *workers]:
        params = group.get("rayStartParams", {})
        assert all(isinstance(v, str) for v in params.values()), "rayStartParams are strings"
        res = _container(group)["resources"]
        if GPU in res["limits"]:  # an extended resource: its request equals its limit
            assert res["requests"][GPU] == res["limits"][GPU]
    for group in workers:
        assert WORKER_REQUIRED <= set(group) <= WORKER_GROUP
        assert group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]
    pinned = re.search(r'"ray\[serve\]==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert cluster["rayVersion"] == pinned.group(1)


def test_cluster_holds_the_application(manifest, serve_config):
    """Serve places every actor: each rank needs a pod with its GPUs and CPUs, then the
    Ingress replicas and the Router fit in what is left (first fit, GPU pods first for
    ranks); the serve Service gets the HTTP and gRPC ports from the head container."""
    cluster = manifest["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    nodes = [_ray_resources(head)]
    for group in cluster["workerGroupSpecs"]:
        nodes += [_ray_resources(group) for _ in range(group["minReplicas"])]
    assert nodes[0]["GPU"] == 0  # the head runs no rank
    (app,) = serve_config["applications"]
    sa = ServeArgs.model_validate(app["args"])
    ranks = sa.autoscaling.min_ranks if sa.autoscaling else sa.dp_size
    actors = [(sa.rank_num_cpus, sa.rank_num_gpus)] * ranks
    actors += [(sa.ingress_num_cpus, 0.0)] * sa.ingress_replicas + [(ROUTER_CPUS, 0.0)]
    for cpus, gpus in actors:
        node = next((n for n in sorted(nodes, key=lambda n: -n["GPU"] * (gpus > 0))
                     if n["CPU"] >= cpus and n["GPU"] >= gpus), None)  # fmt: skip
        assert node is not None, f"no pod left for an actor of {cpus} CPUs, {gpus} GPUs"
        node["CPU"] -= cpus
        node["GPU"] -= gpus
    ports = {p["name"]: p["containerPort"] for p in _container(head)["ports"]}
    assert ports["serve"] == serve_config["http_options"]["port"]
    assert ports["serve-grpc"] == serve_config["grpc_options"]["port"]
    assert ports["gcs-server"] == 6379 and ports["dashboard"] == 8265
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
