"""The typed Python client against a real server process."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.api.schemas import FunctionOut, Quota, TenantOut
from app.client import AdminClient, TensorWasmClient, TensorWasmError
from tests.helpers import ADMIN_TOKEN, EXAMPLES, ServerProcess, server_process


@pytest.fixture(scope="module")
def node(server_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with server_process(tmp_path_factory.mktemp("client-node"), server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN}) as s:
        yield s


@pytest.fixture
def admin(node: ServerProcess) -> Iterator[AdminClient]:
    with AdminClient(node.url, ADMIN_TOKEN) as c:
        yield c


@pytest.fixture
def tenant(node: ServerProcess, admin: AdminClient) -> Iterator[tuple[str, TensorWasmClient]]:
    name = f"c-{uuid.uuid4().hex[:10]}"
    admin.create_tenant(name)
    with TensorWasmClient(node.url, admin.create_api_key(name).key) as c:
        yield name, c


def test_quota_patch_changes_only_the_given_fields(admin: AdminClient) -> None:
    name = f"q-{uuid.uuid4().hex[:10]}"
    t = admin.create_tenant(name, quota={"gpu_memory_bytes": 4096, "max_concurrency": 3})
    assert isinstance(t, TenantOut) and t.quota.gpu_memory_bytes == 4096
    q = admin.update_quota(name, timeout_ms=5000)
    assert isinstance(q, Quota) and (q.timeout_ms, q.gpu_memory_bytes, q.max_concurrency) == (5000, 4096, 3)
    assert admin.get_quota(t.id) == q
    q = admin.replace_quota(t.id, timeout_ms=7000)
    assert q.timeout_ms == 7000 and q.gpu_memory_bytes != 4096 and q.max_concurrency != 3
    with pytest.raises(TensorWasmError) as err:
        admin.update_quota(name, wasm_memory_bytes=1)
    assert (err.value.status, err.value.code) == (422, "validation_error") and "wasm_memory_bytes" in err.value.message


def test_errors_carry_the_envelope(node: ServerProcess, admin: AdminClient, tenant: tuple[str, TensorWasmClient]) -> None:
    _, tw = tenant
    with pytest.raises(TensorWasmError) as err:
        tw.get_function("missing")
    assert (err.value.status, err.value.code) == (404, "not_found") and "not found" in err.value.message
    assert str(err.value) == f"{err.value.message} (not_found, HTTP 404)"
    with pytest.raises(TensorWasmError) as err:
        admin.create_tenant(admin.list_tenants()[0].name)
    assert (err.value.status, err.value.code) == (409, "conflict")
    with TensorWasmClient(node.url, "tw_not_a_key") as stranger, pytest.raises(TensorWasmError) as err:
        stranger.usage()
    assert (err.value.status, err.value.code) == (401, "unauthorized")
    with AdminClient("http://127.0.0.1:9", ADMIN_TOKEN) as nowhere, pytest.raises(TensorWasmError) as err:
        nowhere.list_workers()
    assert (err.value.status, err.value.code) == (0, "unreachable")


def test_deploy_invoke_and_records(tenant: tuple[str, TensorWasmClient], c_guest: Callable[[str], bytes]) -> None:
    name, tw = tenant
    module = (EXAMPLES / "echo.wat").read_bytes()
    seen: list[tuple[int, int]] = []
    first = tw.deploy("echo", module, progress=lambda sent, total: seen.append((sent, total)))
    assert first.created and isinstance(first.function, FunctionOut) and first.function.version == 1
    assert seen and seen[-1] == (len(module), len(module)) and [s for s, _ in seen] == sorted(s for s, _ in seen)
    assert not tw.deploy("echo", module).created  # the same bytes again: 200, not a new function

    result = tw.invoke("echo", b"ping")
    assert result.output == b"ping" and result.invocation_id
    record = tw.get_invocation(result.invocation_id)
    assert (record.function, record.status, record.exit_code) == ("echo", "succeeded", 0)
    with tw.invoke_stream("echo", b"pong") as chunks:
        assert b"".join(chunks) == b"pong"

    tw.deploy("hello", c_guest("hello.c"), env={"GREETING": "hi"}, cgi=True, content_type="text/plain", timeout_ms=2000)
    out = tw.invoke("hello", b"world", query={"x": "1"})
    assert out.content_type.startswith("text/plain") and b"GREETING=hi" in out.output and b"QUERY_STRING=x=1" in out.output
    with pytest.raises(TensorWasmError) as err:
        tw.invoke("hello", b"fail")
    assert (err.value.status, err.value.code, err.value.details["exit_code"]) == (500, "guest_error", 7)
    assert "asked to fail" in err.value.details["stderr_tail"]

    assert {f.name for f in tw.list_functions()} == {"echo", "hello"}
    assert tw.get_function("hello").timeout_ms == 2000
    assert {i.status for i in tw.list_invocations(function="hello").items} == {"succeeded", "guest_error"}
    assert tw.usage().tenant == name
    tw.delete_function("hello")
    assert [f.name for f in tw.list_functions()] == ["echo"]


def test_tenant_admin_calls(admin: AdminClient, tenant: tuple[str, TensorWasmClient]) -> None:
    name, tw = tenant
    assert admin.disable_tenant(name).disabled
    with pytest.raises(TensorWasmError) as err:
        tw.usage()
    assert err.value.status in (401, 403)
    assert not admin.enable_tenant(name).disabled
    assert tw.usage().tenant == name
    keys = admin.list_api_keys(name)
    assert len(keys) == 1
    admin.revoke_api_key(name, keys[0].id)
    with pytest.raises(TensorWasmError) as err:
        tw.usage()
    assert err.value.status == 401
    assert any(w.state for w in admin.list_workers())
    admin.delete_tenant(name)
    assert name not in {t.name for t in admin.list_tenants()}


def test_kernels(tenant: tuple[str, TensorWasmClient], tmp_path: Path) -> None:
    _, tw = tenant
    src = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    assert tw.put_kernel("k", src).name == "k"
    assert [k.name for k in tw.list_kernels()] == ["k"]
    assert tw.get_kernel("k").source == src
    tw.delete_kernel("k")
    assert tw.list_kernels() == []
