"""Function deploy: validation, limits, versions, settings, tenant isolation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.helpers import deploy, new_tenant, wat


async def test_deploy_versions_and_noop_reupload(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await deploy(client, key, "echo", wat("echo"))
    assert r.status_code == 201
    first = r.json()
    assert first["version"] == 1 and len(first["sha256"]) == 64 and first["size"] == len(wat("echo"))

    r = await deploy(client, key, "echo", wat("echo"))  # same bytes: no new version
    assert r.status_code == 200 and r.json()["version"] == 1

    r = await deploy(client, key, "echo", wat("noop"))
    assert r.status_code == 200 and r.json()["version"] == 2 and r.json()["sha256"] != first["sha256"]

    r = await client.get("/v1/functions/echo", headers=key)
    assert [v["version"] for v in r.json()["versions"]] == [1, 2]
    assert [f["name"] for f in (await client.get("/v1/functions", headers=key)).json()] == ["echo"]

    assert (await client.delete("/v1/functions/echo", headers=key)).status_code == 204
    r = await client.get("/v1/functions/echo", headers=key)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert (await client.delete("/v1/functions/echo", headers=key)).status_code == 404


async def test_function_settings_from_query(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, timeout_ms=5000)
    r = await deploy(client, key, "cfg", wat("noop"), env=["A=1", "B=two=2"], content_type="text/plain", timeout_ms=1234)
    assert r.status_code == 201, r.text
    f = r.json()
    assert f["env"] == {"A": "1", "B": "two=2"} and f["content_type"] == "text/plain" and f["timeout_ms"] == 1234
    r = await deploy(client, key, "cfg", wat("noop"), timeout_ms=10_000)  # above the tenant quota
    assert r.status_code == 422
    for bad in (["NOEQUALS"], ["1BAD=x"], ["TW_TENANT=spoof"]):
        r = await deploy(client, key, "cfg", wat("noop"), env=bad)
        assert r.status_code == 422, bad
    # failed updates lost nothing
    assert (await client.get("/v1/functions/cfg", headers=key)).json()["timeout_ms"] == 1234


@pytest.mark.parametrize("name", ["has space", "a" * 64, "dot.name", "ümlaut"])
async def test_function_name_rules(client: httpx.AsyncClient, name: str) -> None:
    _, key = await new_tenant(client)
    r = await deploy(client, key, name, wat("noop"))
    assert r.status_code in (404, 422)
    assert "error" in r.json()


async def test_name_of_63_chars_is_fine(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "a-b_C" + "x" * 58, wat("noop"))).status_code == 201


async def test_wrong_content_type_is_415(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await client.put("/v1/functions/f", content=wat("noop"), headers={**key, "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    "guest,needle",
    [
        (b"\x00asm garbage", "not a valid WebAssembly module"),
        (b"hello world", "this is not a WebAssembly module"),
        (b"\x7fELF\x02\x01\x01", "python3 -m ziglang cc -target wasm32-wasi"),
        (b"", "wat2wasm"),
        (b";; a comment\n(modul)", "not a valid WebAssembly module"),  # text that may be WAT: the parser's words
        ("reactor", "_start"),
        ("forbidden_import", "env.system"),
        ("bad_abi_signature", "tensorwasm.buffer_alloc"),
        ("unknown_abi_function", "tensorwasm.raw_pointer"),
    ],
)
async def test_bad_modules_are_refused(client: httpx.AsyncClient, guest, needle: str) -> None:
    _, key = await new_tenant(client)
    body = guest if isinstance(guest, bytes) else wat(guest)
    r = await deploy(client, key, "bad", body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_module" and needle in err["message"]
    assert (await client.get("/v1/functions/bad", headers=key)).status_code == 404


async def test_module_size_limit_by_content_length(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, max_module_bytes=1000)
    r = await deploy(client, key, "big", wat("noop") + b"\0" * 2000)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert "max_module_bytes quota of 1000 bytes" in r.json()["error"]["message"]


async def test_module_size_limit_stops_reading_a_stream(client: httpx.AsyncClient) -> None:
    """A chunked upload larger than the limit is refused without reading the whole body."""
    _, key = await new_tenant(client, max_module_bytes=64 * 1024)
    sent = 0
    total_chunks = 10_000  # 640 MiB if fully read

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(total_chunks):
            sent += 1
            yield b"\0" * 65536

    r = await client.put("/v1/functions/huge", content=body(), headers={**key, "Content-Type": "application/wasm"})
    assert r.status_code == 413 and f"max_module_bytes quota of {64 * 1024} bytes" in r.json()["error"]["message"]
    assert sent < 10, f"the server read {sent} chunks of a body it had to refuse"


async def test_max_functions(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, max_functions=2)
    assert (await deploy(client, key, "f1", wat("noop"))).status_code == 201
    assert (await deploy(client, key, "f2", wat("noop"))).status_code == 201
    r = await deploy(client, key, "f3", wat("noop"))
    assert r.status_code == 409 and r.json()["error"]["code"] == "quota_exceeded"
    assert (await deploy(client, key, "f2", wat("echo"))).status_code == 200  # updating is fine


async def test_tenant_isolation(client: httpx.AsyncClient) -> None:
    _, a = await new_tenant(client)
    _, b = await new_tenant(client)
    assert (await deploy(client, a, "secret", wat("echo"))).status_code == 201
    assert (await client.get("/v1/functions", headers=b)).json() == []
    assert (await client.get("/v1/functions/secret", headers=b)).status_code == 404
    assert (await client.delete("/v1/functions/secret", headers=b)).status_code == 404
    assert (await client.post("/v1/functions/secret/invoke", headers=b)).status_code == 404
    # same name in another tenant is a different function
    assert (await deploy(client, b, "secret", wat("noop"))).status_code == 201
    assert (await client.get("/v1/functions/secret", headers=a)).json()["size"] == len(wat("echo"))
