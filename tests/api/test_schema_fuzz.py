"""schemathesis against a real server: every operation of openapi.json, as an admin and as a
tenant, with valid and invalid inputs. No answer may be a server error, and every answer must
be one the schema documents (status, content type, body, headers).

The server runs as its own process (uvicorn, real HTTP), so a crash or a traceback in its log
cannot hide behind the test's event loop; its log is checked too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from tests.helpers import ADMIN, ADMIN_TOKEN, ROOT, wat

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25  # per operation and generation mode: ~1,400 requests in all
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
CUDA_SOURCE = 'extern "C" __global__ void scale(float *x, float a, int n) {\n'
CUDA_SOURCE += "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) x[i] *= a;\n}\n"


@schemathesis.serializer("application/wasm")
def _wasm(ctx: Any, value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


@schemathesis.serializer("application/x-tar")
def _tar(ctx: Any, value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


SPEC = create_app().openapi()
SCHEMA = schemathesis.openapi.from_dict(SPEC)
OPERATIONS = [(method.upper(), path) for path, ops in SPEC["paths"].items() for method in ops]
# invalid inputs exist only where an operation takes some
CASES = [
    (method.upper(), path, mode)
    for path, ops in SPEC["paths"].items()
    for method, op in ops.items()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or op.get("parameters") or op.get("requestBody")
]
WASM = wat("echo")


@SCHEMA.hook("map_case")
def real_bodies(context: Any, case: Any) -> Any:
    """Deploys carry a real module and kernel uploads real CUDA source; random bytes would only
    ever meet the validator."""
    op = case.operation
    if op.method.upper() == "PUT" and op.path == "/v1/functions/{name}":
        case.body, case.media_type = WASM, "application/wasm"
    elif op.method.upper() == "PUT" and op.path == "/v1/kernels/{name}":
        case.body, case.media_type = CUDA_SOURCE, "text/plain"
    return case


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(server_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir = tmp_path_factory.mktemp("fuzz")
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "TENSORWASM_DATABASE_URL": server_database_url,
        "TENSORWASM_DATA_DIR": str(data_dir),
        "TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN,
        "TENSORWASM_BACKEND": "cpu",
        "TENSORWASM_MAX_WORKERS": "2",
        "TENSORWASM_LOG_FORMAT": "json",
    }
    log_path = data_dir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory", "--port", str(port), "--log-level", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            for _ in range(600):
                try:
                    if c.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.1)
            # the caller: high limits, so the fuzzing meets the code paths, not the quota
            quota = {"max_functions": 10_000, "requests_per_second": 100_000, "max_concurrency": 64}
            r = c.post("/v1/admin/tenants", json={"name": f"fuzz-{uuid.uuid4().hex[:8]}", "quota": quota}, headers=ADMIN)
            caller = r.json()["id"]
            key = c.post(f"/v1/admin/tenants/{caller}/api-keys", headers=ADMIN).json()["key"]
            tenant = {"Authorization": f"Bearer {key}"}
            # the target of the admin operations (its quota and name get fuzzed)
            target = c.post("/v1/admin/tenants", json={"name": f"target-{uuid.uuid4().hex[:8]}"}, headers=ADMIN).json()["id"]
            r = c.put("/v1/functions/echo", content=WASM, params={"content_type": "text/plain; charset=utf-8"},
                      headers={**tenant, "Content-Type": "application/wasm"})
            assert r.status_code in (200, 201), r.text
        yield {"base": base, "tenant": tenant, "target": target, "log": log_path}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log_text = log_path.read_text()
    assert "Traceback" not in log_text, log_text[-4000:]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_operation_conforms(server: dict[str, Any], method: str, path: str, mode: GenerationMode) -> None:
    operation = SCHEMA[path][method]
    fixed: dict[str, Any] = {}
    if "{tenant_id}" in path and method != "DELETE":
        fixed["tenant_id"] = server["target"]  # a real tenant, so bodies reach the database
    if path == "/v1/functions/{name}/invoke":
        fixed["name"] = "echo"
    auth = ADMIN if path.startswith("/v1/admin/") else server["tenant"] if path.startswith("/v1/") else {}

    @given(case=operation.as_strategy(generation_mode=mode, path_parameters=fixed or None))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        response = case.call(base_url=server["base"], headers=auth, timeout=60)
        case.validate_response(response, checks=CHECKS)

    run()


def test_every_operation_is_fuzzed() -> None:
    """The parametrization covers the whole document (nothing silently left out)."""
    assert len(OPERATIONS) == sum(len(ops) for ops in SPEC["paths"].values()) >= 25
    assert Path(ROOT / "openapi.json").exists()
