"""The command line's async and streaming commands against a real node."""

from __future__ import annotations

import io
from collections.abc import Iterator

import httpx
import pytest

from app.queue import cli_support as cli
from tests.helpers import ADMIN, Node, fresh_database, wat


@pytest.fixture(scope="module")
def tenant_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    tmp = tmp_path_factory.mktemp("cli-node")
    url, drop = fresh_database(tmp)
    node = Node(url, tmp / "data").start()
    with httpx.Client(base_url=node.url, timeout=30) as admin:
        tid = admin.post("/v1/admin/tenants", json={"name": "cli", "quota": {"timeout_ms": 20_000, "max_concurrency": 1}}, headers=ADMIN).json()["id"]
        key = admin.post(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN).json()["key"]
    with httpx.Client(base_url=node.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
        for fn in ("echo", "exit3", "utf8_lines", "write_then_spin"):
            assert c.put(f"/v1/functions/{fn}", content=wat(fn), headers={"Content-Type": "application/wasm"}).status_code == 201
        yield c
    node.stop()
    drop()


def test_async_prints_id_then_get_output(tenant_client: httpx.Client) -> None:
    out, err = io.BytesIO(), io.StringIO()
    assert cli.invoke_async(tenant_client, "echo", b"later", out=out, err=err) == 0
    inv = out.getvalue().decode().strip()
    assert len(inv) == 32
    got = io.StringIO()
    assert cli.invocation_get(tenant_client, inv, out=got) == 0 and f'"id": "{inv}"' in got.getvalue()
    data = io.BytesIO()
    cli.invoke_async(tenant_client, "echo", b"x", wait=True, out=io.BytesIO(), err=io.StringIO())  # drains behind it
    assert cli.invocation_output(tenant_client, inv, out=data, err=io.StringIO()) == 0 and data.getvalue() == b"later"


def test_async_wait_writes_output_and_fails_on_guest_error(tenant_client: httpx.Client) -> None:
    out, err = io.BytesIO(), io.StringIO()
    assert cli.invoke_async(tenant_client, "echo", b"waited", wait=True, out=out, err=err) == 0
    assert out.getvalue() == b"waited" and "queued" in err.getvalue()
    out, err = io.BytesIO(), io.StringIO()
    assert cli.invoke_async(tenant_client, "exit3", b"", wait=True, out=out, err=err) == 1
    assert out.getvalue() == b"partial output\n" and "guest_error" in err.getvalue()


def test_stream_writes_as_produced(tenant_client: httpx.Client) -> None:
    out, err = io.BytesIO(), io.StringIO()
    assert cli.invoke_stream(tenant_client, "utf8_lines", b"", out=out, err=err) == 0
    assert out.getvalue().decode() == "héllo\nwörld\n"
    out, err = io.BytesIO(), io.StringIO()
    assert cli.invoke_stream(tenant_client, "exit3", b"", out=out, err=err) == 1
    assert "guest_error" in err.getvalue()


def test_cancel_and_errors_print_server_message(tenant_client: httpx.Client) -> None:
    out = io.BytesIO()
    assert cli.invoke_async(tenant_client, "write_then_spin", b"", out=out, err=io.StringIO()) == 0
    inv = out.getvalue().decode().strip()
    said = io.StringIO()
    assert cli.invocation_cancel(tenant_client, inv, out=said) == 0 and said.getvalue().strip() == "cancelled"
    err = io.StringIO()
    assert cli.invocation_cancel(tenant_client, inv, out=io.StringIO(), err=err) == 1
    assert "already_finished" in err.getvalue() and "HTTP 409" in err.getvalue()
    err = io.StringIO()
    assert cli.invoke_async(tenant_client, "missing", b"", err=err) == 1 and "not_found" in err.getvalue()
