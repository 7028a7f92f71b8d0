"""A real Prometheus scrapes a running server under load; every PromQL expression of every
dashboard returns data (no panel refers to a metric the platform does not export)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from app.bench.node import server, setup_tenant
from tests.gpu.runner import Buf, rec_buf, rec_f32, rec_i32, request
from tests.helpers import wat

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
PROMETHEUS = shutil.which("prometheus")

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's `prometheus` package (.ci/run installs it)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard_exprs() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel["targets"]:
                out.append((path.name, panel["title"], t["expr"]))
    return out


def test_every_dashboard_query_returns_data(tmp_path: Path, c_guest) -> None:
    assert DASHBOARDS, "no dashboards found"
    # two fronts whatever the machine: the supervisor's families are on the dashboards too
    with server(TENSORWASM_MAX_WORKERS="3", TENSORWASM_PROCESSES="2") as base:
        port = base.rsplit(":", 1)[1]
        config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
        job = next(j for j in config["scrape_configs"] if j["job_name"] == "tensorwasm")
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
        job["scrape_interval"] = "1s"
        config["scrape_configs"] = [job]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_port = _port()
        prom = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            with httpx.Client(base_url=base, timeout=60) as client:
                gpu = setup_tenant(client, "gpu-tenant", {"runner": c_guest("kernel_runner.c"), "trap": wat("trap")}, gpu_memory_bytes=1 << 20)
                limited = setup_tenant(client, "limited", {"echo": wat("echo")}, requests_per_second=1)
                launch = request("scale_f32", [Buf(64)], [rec_buf(0), rec_f32(2), rec_i32(16)], [0], repeat=5)
                deadline = time.monotonic() + 10
                i = 0
                while time.monotonic() < deadline:  # bounded load on loopback only
                    assert client.post("/v1/functions/runner/invoke", content=launch, headers=gpu).status_code == 200
                    client.post("/v1/functions/trap/invoke", headers=gpu)
                    client.post("/v1/functions/echo/invoke", content=b"x", headers=limited)  # mostly 429
                    if i % 40 == 0:  # a fresh tenant now and then: cold starts while being scraped
                        fresh = setup_tenant(client, f"cold-{i}", {"echo": wat("echo")})
                        client.post("/v1/functions/echo/invoke", content=b"y", headers=fresh)
                    i += 1
                    time.sleep(0.02)

            prom_api = f"http://127.0.0.1:{prom_port}/api/v1/query"
            missing = []
            for dash, title, expr in dashboard_exprs():
                q = expr.replace("$__rate_interval", "30s").replace("$tenant", ".*")
                body = httpx.get(prom_api, params={"query": q}, timeout=10).json()
                if body.get("status") != "success" or not body["data"]["result"]:
                    missing.append(f"{dash} / {title}: {expr} -> {body.get('error') or 'no data'}")
            assert not missing, "\n".join(missing)
            # the tenant variable's query has values too
            values = httpx.get(f"http://127.0.0.1:{prom_port}/api/v1/label/tenant/values", params={"match[]": "tensorwasm_invocations_total"}).json()
            assert "gpu-tenant" in values["data"]
        finally:
            prom.terminate()
            prom.wait(timeout=30)
