"""docker/k8s/ validates offline: core kinds against Kubernetes' own schemas (kubernetes-validate
bundles them), the InferencePool against the v1 fields it uses, and the wiring that keeps
tenants away from Triton's admin APIs and metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from backend.triton import placement_metrics as pm
from control.ops.front_door import DoorConfig, Upstream, render

K8S = Path(__file__).resolve().parents[2] / "docker" / "k8s"
KUBERNETES_VERSION = "1.33.0"
CRD_KINDS = {"InferencePool", "HTTPRoute"}

# The InferencePool v1 (inference.networking.k8s.io) fields loraplane uses, from the CRD:
# selector.matchLabels, targetPorts (1..8 ports, number 1..65535), appProtocol (http |
# kubernetes.io/h2c), endpointPickerRef (group, kind, name, port.number, failureMode FailOpen |
# FailClose; port is required when kind is Service).
_NAME = {"type": "string", "minLength": 1, "maxLength": 253,
         "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
_PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": _NAME}},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1, "maxProperties": 64,
                        "additionalProperties": {"type": "string", "maxLength": 63}}},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8,
                                "uniqueItems": True, "items": _PORT},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": _NAME,
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    "if": {"properties": {"kind": {"const": "Service"}}},
                    "then": {"required": ["name", "port"]},
                },
            },
        },
    },
}


def _docs() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in _docs() if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def test_every_file_is_a_kustomize_resource() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_core_kinds_validate_against_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    core = [d for d in _docs() if d["kind"] not in CRD_KINDS]
    kinds = {d["kind"] for d in core}
    assert {"Deployment", "StatefulSet", "Service", "NetworkPolicy", "ConfigMap", "Secret",
            "PersistentVolumeClaim"} <= kinds
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_wrong_field_is_caught() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    bad = _one("StatefulSet")
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    pool = _one("InferencePool")
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL_V1)


def test_inference_pool_uses_v1_fields_and_targets_the_front_door() -> None:
    pool = _one("InferencePool")
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    spec = pool["spec"]
    hosts = _one("StatefulSet", "loraplane-triton")["spec"]["template"]
    assert spec["selector"]["matchLabels"].items() <= hosts["metadata"]["labels"].items()
    door = next(c for c in hosts["spec"]["containers"] if c["name"] == "front-door")
    assert [p["number"] for p in spec["targetPorts"]] == [
        p["containerPort"] for p in door["ports"] if p["name"] == "http"]
    epp = _one("Service", "loraplane-epp")
    ref = spec["endpointPickerRef"]
    assert ref["name"] == epp["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in epp["spec"]["ports"]}


def test_triton_hosts_have_gpus_readiness_and_metrics() -> None:
    spec = _one("StatefulSet", "loraplane-triton")["spec"]["template"]["spec"]
    triton = next(c for c in spec["containers"] if c["name"] == "triton")
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert {p["name"]: p["containerPort"] for p in triton["ports"]}["metrics"] == 8002
    control = _one("Deployment", "loraplane-control")["spec"]["template"]["spec"]
    assert [c["command"][-2:] for c in control["initContainers"]] == [["db", "upgrade"]]
    for doc in (_one("Deployment", "loraplane-control"), _one("StatefulSet")):
        for c in doc["spec"]["template"]["spec"].get("containers", []):
            for e in c.get("env", []):
                if e["name"].endswith("DB_URL"):
                    assert e["valueFrom"]["secretKeyRef"]["name"] == "loraplane-database"


def test_front_door_config_is_the_rendered_one() -> None:
    """The sidecar's config is the rendered door, its OpenAI route on the port the triton
    container's host serves it on (issue 25)."""
    cm = _one("ConfigMap", "loraplane-front-door")
    command = next(c for c in _one("StatefulSet", "loraplane-triton")["spec"]["template"]
                   ["spec"]["containers"] if c["name"] == "triton")["command"]
    openai = int(command[command.index("--openai-port") + 1])
    expected = render(DoorConfig(listen="*", http_port=8000, grpc_port=8001,
                                 upstreams=(Upstream("127.0.0.1", 8100, 8101),),
                                 openai_port=openai))
    assert cm["data"]["haproxy.cfg"].strip() == expected.strip()
    assert "use_backend host_openai if post openai" in cm["data"]["haproxy.cfg"]


def test_network_policies_keep_tenants_off_admin_apis_and_metrics() -> None:
    policy = _one("NetworkPolicy", "loraplane-triton-ingress")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    allowed: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            allowed.setdefault(port["port"], []).extend(rule["from"])
    assert set(allowed) == {8000, 8001, 8002, 8100, 8101}
    control = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "loraplane-control"}}}
    assert allowed[8100] == [control] and allowed[8101] == [control]
    gateway = {"namespaceSelector": {"matchLabels": {"loraplane.io/gateway": "true"}}}
    assert gateway in allowed[8000] and gateway not in allowed[8002]
    assert all("ipBlock" not in peer for peers in allowed.values() for peer in peers)


def test_epp_reads_loraplanes_metrics_with_the_lora_affinity_scorer() -> None:
    cm = _one("ConfigMap", "loraplane-epp")
    config = yaml.safe_load(cm["data"]["epp.yaml"])
    assert "lora-affinity-scorer" in {p["type"] for p in config["plugins"]}
    engine = yaml.safe_load(cm["data"]["engine.yaml"])
    assert engine["totalQueuedRequestsMetric"] == pm.WAITING
    assert engine["totalRunningRequestsMetric"] == pm.RUNNING
    assert engine["kvCacheUsagePercentageMetric"] == pm.KV_USAGE
    assert engine["loraInfoMetric"] == pm.LORA_INFO
    assert engine["loraResidencyMetric"] == pm.LORA_LOADED
    args = _one("Deployment", "loraplane-epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--lora-info-metric={pm.LORA_INFO}" in args
    assert f"--kv-cache-usage-percentage-metric={pm.KV_USAGE}" in args
    assert f"--total-queued-requests-metric={pm.WAITING}" in args
    assert f"--total-running-requests-metric={pm.RUNNING}" in args
    assert f"--model-server-metrics-port={engine['metricsPort']}" in args


def test_route_sends_only_inference_and_health_to_the_pool() -> None:
    route = _one("HTTPRoute")
    pool_rules = [r for r in route["spec"]["rules"]
                  if r["backendRefs"][0].get("kind") == "InferencePool"]
    paths = [m["path"]["value"] for r in pool_rules for m in r["matches"]]
    assert paths and not any("repository" in p or "shm" in p or "trace" in p or "logging" in p
                             for p in paths)
