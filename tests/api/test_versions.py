"""Versions as a user meets them over HTTP: every deploy or change of settings makes one, a
rollback changes what the next call runs, a call may pin one (sync, streamed, async), records
carry the version that ran, and pruned versions are gone (the active one never)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.api.test_call_args import _report
from tests.helpers import deploy, new_tenant, submit, wait_status, wat


async def _invoke(client: httpx.AsyncClient, key: dict[str, str], name: str, body: bytes = b"hi", **headers: str) -> httpx.Response:
    return await client.post(f"/v1/functions/{name}/invoke", content=body, headers={**key, **headers})


async def test_settings_changes_make_versions_and_rollback_runs_the_old_one(
    client: httpx.AsyncClient, c_guest: Callable[[str], bytes]
) -> None:
    _, key = await new_tenant(client)
    probe = c_guest("wasi_probe.c")
    assert (await deploy(client, key, "p", probe, arg=["env"], env=["GREETING=hello"])).json()["version"] == 1
    r = await deploy(client, key, "p", probe, env=["GREETING=bye"])  # same module, new env: a new version
    assert r.status_code == 200 and r.json()["version"] == 2 and r.json()["env"] == {"GREETING": "bye"}
    assert (await deploy(client, key, "p", probe)).json()["version"] == 2  # nothing changed: no new version
    r = await deploy(client, key, "p", probe, content_type="text/plain")
    assert r.json()["version"] == 3
    assert _report((await _invoke(client, key, "p")).text)[1]["GREETING"] == "bye"

    r = await client.get("/v1/functions/p/versions", headers=key)
    assert r.status_code == 200, r.text
    versions = r.json()
    assert [(v["version"], v["active"], v["env"]) for v in versions] == [
        (1, False, {"GREETING": "hello"}), (2, False, {"GREETING": "bye"}), (3, True, {"GREETING": "bye"}),
    ]
    assert versions[2]["content_type"] == "text/plain" and versions[0]["args"] == ["env"]

    r = await client.post("/v1/functions/p/rollback", json={"version": 1}, headers=key)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 1 and r.json()["env"] == {"GREETING": "hello"}
    assert r.json()["content_type"] == "application/octet-stream"
    r = await _invoke(client, key, "p")
    assert _report(r.text)[1]["GREETING"] == "hello" and r.headers["content-type"] == "application/octet-stream"
    # the record says which version ran
    rec = (await client.get(f"/v1/invocations/{r.headers['x-invocation-id']}", headers=key)).json()
    assert rec["version"] == 1
    # a deploy after a rollback is numbered after the newest, from the active version's settings
    r = await deploy(client, key, "p", probe, timeout_ms=2000)
    assert r.json()["version"] == 4 and r.json()["env"] == {"GREETING": "hello"}


async def test_rollback_changes_the_module_and_pins_run_their_version(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "f", wat("echo"))
    await deploy(client, key, "f", wat("noop"))
    assert (await _invoke(client, key, "f")).content == b""  # noop, version 2
    # pinned: sync, streamed (raw and SSE) and async each run version 1
    r = await _invoke(client, key, "f", **{"X-Function-Version": "1"})
    assert r.status_code == 200 and r.content == b"hi"
    rec = (await client.get(f"/v1/invocations/{r.headers['x-invocation-id']}", headers=key)).json()
    assert rec["version"] == 1
    r = await client.post("/v1/functions/f/invoke?stream=raw", content=b"raw", headers={**key, "X-Function-Version": "1"})
    assert r.status_code == 200 and r.content == b"raw"
    r = await client.post("/v1/functions/f/invoke", content=b"sse", headers={**key, "X-Function-Version": "1",
                                                                              "Accept": "text/event-stream"})
    assert "data: sse" in r.text
    r = await submit(client, key, "f", b"later", {"X-Function-Version": "1"})
    assert r.status_code == 202 and r.json()["version"] == 1, r.text
    rec = await wait_status(client, key, r.json()["id"], "succeeded")
    assert rec["version"] == 1
    assert (await client.get(f"/v1/invocations/{rec['id']}/output", headers=key)).content == b"later"

    r = await client.post("/v1/functions/f/rollback", json={"version": 1}, headers=key)
    assert r.status_code == 200 and r.json()["version"] == 1
    assert (await _invoke(client, key, "f")).content == b"hi"  # the next call runs version 1
    assert (await _invoke(client, key, "f", **{"X-Function-Version": "2"})).content == b""


async def test_unknown_versions_and_bad_pins(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "f", wat("echo"))
    for send in (
        lambda: _invoke(client, key, "f", **{"X-Function-Version": "7"}),
        lambda: client.post("/v1/functions/f/invoke?stream=raw", headers={**key, "X-Function-Version": "7"}),
        lambda: submit(client, key, "f", b"", {"X-Function-Version": "7"}),
        lambda: client.post("/v1/functions/f/rollback", json={"version": 7}, headers=key),
    ):
        r = await send()
        assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found", r.text
    for bad, status in (("one", 400), ("-1", 400), ("0", 422), ("99999999999", 422)):
        r = await _invoke(client, key, "f", **{"X-Function-Version": bad})
        assert r.status_code == status and r.json()["error"]["code"] in ("bad_request", "validation_error"), (bad, r.text)
    for body in ({"version": 0}, {"version": "x"}, {}, {"version": 1, "extra": 1}):
        r = await client.post("/v1/functions/f/rollback", json=body, headers=key)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
    assert (await client.post("/v1/functions/nope/rollback", json={"version": 1}, headers=key)).status_code == 404
    assert (await client.get("/v1/functions/nope/versions", headers=key)).status_code == 404
    # nothing changed by the refusals
    assert (await client.get("/v1/functions/f", headers=key)).json()["version"] == 1


async def test_pruned_versions_are_gone(app_factory: Callable[..., object]) -> None:
    async with app_factory(kept_versions=2) as (client, _):  # type: ignore[attr-defined]
        _, key = await new_tenant(client)
        for v in range(1, 4):
            assert (await deploy(client, key, "f", wat("echo"), env=[f"V={v}"])).json()["version"] == v
        assert [v["version"] for v in (await client.get("/v1/functions/f/versions", headers=key)).json()] == [2, 3]
        r = await client.post("/v1/functions/f/rollback", json={"version": 1}, headers=key)
        assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found"
        r = await _invoke(client, key, "f", **{"X-Function-Version": "1"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found"
        assert (await client.post("/v1/functions/f/rollback", json={"version": 2}, headers=key)).status_code == 200
        assert (await _invoke(client, key, "f")).content == b"hi"
        # the next deploy is active, numbered after the newest; the oldest goes
        assert (await deploy(client, key, "f", wat("noop"))).json()["version"] == 4
        versions = (await client.get("/v1/functions/f/versions", headers=key)).json()
        assert [(v["version"], v["active"]) for v in versions] == [(3, False), (4, True)]
        assert (await _invoke(client, key, "f")).content == b""
