"""Kubernetes manifests and the compose file pass schema validation (not string checks)."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema
from jsonschema.validators import validator_for

ROOT = Path(__file__).resolve().parents[2]
K8S = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
K8S_VERSION = "1.31.0"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", [p for p in K8S if p.name != "kustomization.yaml"], ids=lambda p: p.name)
def test_kubernetes_manifests_are_valid(path: Path) -> None:
    for doc in _docs(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = set(_docs(ROOT / "deploy" / "k8s" / "kustomization.yaml")[0]["resources"])
    assert listed == {p.name for p in K8S} - {"kustomization.yaml"}


def test_gpu_workload_shape() -> None:
    docs = {d["kind"]: d for p in K8S for d in _docs(p)}
    pod = docs["Deployment"]["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    db = next(e for e in c["env"] if e["name"] == "TENSORWASM_DATABASE_URL")
    assert "secretKeyRef" in db["valueFrom"]
    assert docs["Ingress"]["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]


def test_compose_file_is_valid() -> None:
    schema = get_builtin_schema("vendor.compose-spec")
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    errors = sorted(validator_for(schema)(schema).iter_errors(doc), key=str)  # the draft the schema declares
    assert not errors, "\n".join(e.message for e in errors)
    assert {"api", "postgres", "prometheus", "grafana"} <= set(doc["services"])
    doc["services"]["api"]["restartt"] = "always"  # the validator does catch a bad key
    assert list(validator_for(schema)(schema).iter_errors(doc))
    for svc in doc["services"].values():
        for vol in svc.get("volumes", []):
            host = vol.split(":")[0]
            if host.startswith("./"):
                assert (ROOT / host).exists(), f"compose mounts {host}, which is not in the repo"


def test_dashboards_are_provisioned_json() -> None:
    for path in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"):
        d = json.loads(path.read_text())
        assert d["uid"].startswith("tensorwasm-") and d["panels"]
