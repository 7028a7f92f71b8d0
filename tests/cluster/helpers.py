"""A real cluster for the tests: deploy/cluster/up.sh (nginx hashing the Authorization header in
front of `tensorwasm serve` nodes) on a fresh PostgreSQL database of its own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.helpers import (
    ADMIN,
    ADMIN_TOKEN,
    LIVE_SERVERS,
    ROOT,
    ServerProcess,
    checkout_pythonpath,
    free_port,
    fresh_postgres_database,
)

UP = ROOT / "deploy" / "cluster" / "up.sh"
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
POSTGRES = os.environ.get("TENSORWASM_TEST_DATABASE_URL")

# every test of a module that starts clusters
needs_cluster = [
    pytest.mark.slow,
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx; .ci/run installs it)"),
    pytest.mark.skipif(not POSTGRES, reason="the nodes of a cluster share PostgreSQL: set TENSORWASM_TEST_DATABASE_URL"),
]


@dataclass
class ClusterNode:
    name: str
    port: int
    pid: int  # of its process group (setsid): the node and its workers

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """As nginx names it in X-TensorWasm-Node."""
        return f"127.0.0.1:{self.port}"


@dataclass
class Cluster:
    url: str  # nginx
    database_url: str
    nodes: list[ClusterNode]
    dir: Path

    def node(self, name: str) -> ClusterNode:
        return next(n for n in self.nodes if n.name == name)

    def kill(self, name: str) -> datetime:
        """kill -9 of a node and its workers, as if its machine died; returns when."""
        os.killpg(self.node(name).pid, signal.SIGKILL)
        return datetime.now(UTC)

    def drain(self, name: str) -> None:
        """Stop a node cleanly (SIGTERM to the node alone, as an orchestrator drains it): it
        refuses new connections and finishes the calls it holds."""
        os.kill(self.node(name).pid, signal.SIGTERM)

    def tenant(self, prefix: str = "c", **quota: object) -> tuple[str, dict[str, str]]:
        """A new tenant (with `quota`'s fields, the defaults otherwise) and an API key (through
        nginx); returns (tenant id, auth headers)."""
        with httpx.Client(base_url=self.url, timeout=30) as c:
            r = c.post("/v1/admin/tenants", json={"name": f"{prefix}-{uuid.uuid4().hex[:10]}", "quota": quota}, headers=ADMIN)
            assert r.status_code == 201, r.text
            tid = r.json()["id"]
            r = c.post(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)
            assert r.status_code == 201, r.text
            return tid, {"Authorization": f"Bearer {r.json()['key']}"}

    def deploy(self, key: dict[str, str], name: str, wasm: bytes, url: str | None = None, **params: object) -> httpx.Response:
        return httpx.put(f"{url or self.url}/v1/functions/{name}", content=wasm, params=params,  # type: ignore[arg-type]
                         headers={**key, "Content-Type": "application/wasm"}, timeout=60)


@contextmanager
def cluster(tmp_path: Path, nodes: int = 2, **env: str) -> Iterator[Cluster]:
    """Start deploy/cluster/up.sh and wait until nginx and every node answer; stop it all after."""
    assert POSTGRES
    database_url, drop = fresh_postgres_database(POSTGRES)
    ports = [free_port() for _ in range(nodes)]
    listen = free_port()
    state = tmp_path / f"cluster-{uuid.uuid4().hex[:6]}"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORWASM_", "CLUSTER_"))}
    full.update(
        PYTHONPATH=checkout_pythonpath(),
        TENSORWASM_DATABASE_URL=database_url,
        TENSORWASM_ADMIN_TOKEN=ADMIN_TOKEN,
        TENSORWASM_BACKEND="cpu",
        TENSORWASM_PROCESSES="1",  # a small box runs several nodes here: one process each
        TENSORWASM_MAX_WORKERS="4",
        TENSORWASM_LOG_FORMAT="console",
        TENSORWASM_LOG_LEVEL="warning",
        TENSORWASM_ACCESS_LOG="false",
        CLUSTER_NODES=str(nodes),
        CLUSTER_LISTEN=f"127.0.0.1:{listen}",
        CLUSTER_NODE_PORTS=" ".join(map(str, ports)),
        CLUSTER_DIR=str(state),
        CLUSTER_SERVE=f"{sys.executable} -m app.cli",  # this checkout's, as the other tests run it
    )
    full.update(env)
    state.mkdir(parents=True)
    log_path = state / "up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(UP)], env=full, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    shown = [ServerProcess(f"http://127.0.0.1:{ports[i]}", proc, state / f"node-{i + 1}" / "serve.log") for i in range(nodes)]
    shown.append(ServerProcess(f"http://127.0.0.1:{listen}", proc, log_path))
    try:
        deadline = time.monotonic() + 120
        while not (state / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, f"the cluster did not start:\n{log_path.read_text()}"
            time.sleep(0.2)
        LIVE_SERVERS.update(shown)  # a failing test shows the ends of their logs
        members = []
        for line in (state / "nodes").read_text().splitlines():
            name, port, pid = line.split()
            members.append(ClusterNode(name, int(port), int(pid)))
        yield Cluster(f"http://127.0.0.1:{listen}", database_url, members, state)
    finally:
        LIVE_SERVERS.difference_update(shown)
        if proc.poll() is None:
            proc.terminate()  # up.sh stops nginx and every node
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        drop()
