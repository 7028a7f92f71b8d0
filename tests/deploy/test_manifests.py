"""Kubernetes manifests and the compose file pass schema validation (not string checks)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema
from jsonschema.validators import validator_for

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
K8S = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
K8S_VERSION = "1.31.0"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


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
    assert {"nginx", "api-1", "api-2", "postgres", "prometheus", "grafana"} <= set(doc["services"])
    doc["services"]["api-1"]["restartt"] = "always"  # the validator does catch a bad key
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


def test_compose_publishes_no_default_secret() -> None:
    """Every published port is bound to loopback, and the nodes refuse to start without an admin
    token (compose's ${VAR:?message}): no `change-me` on a port open to all."""
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, svc in doc["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
        env = svc.get("environment") or {}
        token = env.get("TENSORWASM_ADMIN_TOKEN")
        if token is not None:
            assert token.startswith("${TENSORWASM_ADMIN_TOKEN:?"), f"{name}'s admin token has a default: {token}"
            # the nodes share one secrets key, given: each would otherwise generate its own, and
            # a secret sealed on one node would not open on another
            assert env.get("TENSORWASM_SECRETS_KEY", "").startswith("${TENSORWASM_SECRETS_KEY:?"), name
    assert "ports" not in doc["services"]["api-1"] and "ports" not in doc["services"]["postgres"]


def test_kubernetes_applies_no_placeholder_secret_and_names_the_documented_image() -> None:
    applied = [d for name in _docs(ROOT / "deploy" / "k8s" / "kustomization.yaml")[0]["resources"]
               for d in _docs(ROOT / "deploy" / "k8s" / name)]
    assert not [d for d in applied if d["kind"] == "Secret"]  # created by the operator, never a CHANGE-ME
    pod = next(d for d in applied if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images == {"tensorwasm:cuda"}
    # every pod seals and opens secrets with the one key of the operator's Secret
    (api,) = pod["containers"]
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}) for e in api["env"]}
    assert env["TENSORWASM_SECRETS_KEY"] == {"name": "tensorwasm", "key": "secrets-key"}
    assert "--from-literal=secrets-key=" in (ROOT / "docs" / "operations.md").read_text()
    # the image the docs say how to build, from the Dockerfile's CUDA target
    assert "docker build --target cuda -t tensorwasm:cuda ." in (ROOT / "docs" / "operations.md").read_text()
    assert re.search(r"^FROM \S+ AS cuda$", (ROOT / "Dockerfile").read_text(), re.M)


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx; .ci/run installs it)")
def test_the_compose_balancer_config_is_accepted_by_nginx(tmp_path: Path) -> None:
    """nginx -t on the compose file's nginx.conf, its node names pointed at loopback (they resolve
    only on the compose network)."""
    conf = (ROOT / "deploy" / "cluster" / "nginx.compose.conf").read_text()
    assert "hash $http_authorization consistent;" in conf
    conf = conf.replace("server api-1:8080", "server 127.0.0.1:1").replace("server api-2:8080", "server 127.0.0.1:2")
    conf = conf.replace("/tmp/nginx", str(tmp_path / "nginx")).replace("listen 8080;", f"listen 127.0.0.1:{free_port()};")
    (tmp_path / "nginx.conf").write_text(conf)
    res = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", str(tmp_path / "error.log")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
