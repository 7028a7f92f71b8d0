"""A guest's argv and environment through the API: a deploy's default arguments, a call's own
(X-Function-Args, in every mode), their bounds, and an environment that is exactly the deployed
one unless the function asked for the request variables (cgi=true)."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from app.services.guest_inputs import CGI_VARIABLES, MAX_ARGS, MAX_ARGS_BYTES
from tests.helpers import ADMIN, deploy, new_tenant, submit, wait_status


def _report(text: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) as wasi_probe prints them."""
    argv: list[str] = []
    env: dict[str, str] = {}
    for line in text.split("\n"):
        kind, _, value = line.partition("=")
        value = value.replace("\\n", "\n").replace("\\\\", "\\")
        if kind == "arg":
            argv.append(value)
        elif kind == "env":
            key, _, val = value.partition("=")
            env[key] = val
    return argv, env


async def _call(
    client: httpx.AsyncClient, key: dict[str, str], name: str, args: object = None,
    headers: dict[str, str] | None = None, params: dict[str, str] | None = None,
) -> httpx.Response:
    sent = {**key, **(headers or {})}
    if args is not None:
        sent["X-Function-Args"] = args if isinstance(args, str) else json.dumps(args)
    return await client.post(f"/v1/functions/{name}/invoke", headers=sent, params=params)


async def test_default_arguments_and_a_calls_own(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    _, key = await new_tenant(client)
    r = await deploy(client, key, "probe", c_guest("wasi_probe.c"), arg=["env", "the \"second\" arg", "", "ünï"])
    assert r.status_code == 201 and r.json()["args"] == ["env", "the \"second\" arg", "", "ünï"], r.text
    r = await _call(client, key, "probe")
    assert r.status_code == 200, r.text
    assert _report(r.text)[0] == ["probe", "env", "the \"second\" arg", "", "ünï"]
    # a call's own arguments replace the defaults; argv[0] stays the function's name
    r = await _call(client, key, "probe", ["env", "a\nb", "c"])
    assert _report(r.text)[0] == ["probe", "env", "a\nb", "c"]
    r = await _call(client, key, "probe", [])  # none at all: the probe's default command
    assert _report(r.text)[0] == ["probe"]
    # a redeploy without arg= keeps them; with arg= replaces them
    r = await deploy(client, key, "probe", c_guest("wasi_probe.c"), env=["X=1"])
    assert r.json()["args"] == ["env", "the \"second\" arg", "", "ünï"]
    r = await deploy(client, key, "probe", c_guest("wasi_probe.c"), arg=["env"])
    assert r.json()["args"] == ["env"]
    assert _report((await _call(client, key, "probe")).text)[0] == ["probe", "env"]


@pytest.mark.parametrize(
    "header,status",
    [
        ("not json", 400),
        ('["unterminated', 400),
        ('{"a": 1}', 422),
        ('"one"', 422),
        ("[1, 2]", 422),
        ('["a", null]', 422),
        ('["nul\\u0000byte"]', 422),
        (json.dumps(["x"] * (MAX_ARGS + 1)), 422),
        (json.dumps(["x" * (MAX_ARGS_BYTES // 2 + 1)] * 2), 422),
    ],
    ids=["text", "truncated", "object", "string", "numbers", "null", "nul", "too-many", "too-long"],
)
async def test_bad_call_arguments_are_refused_in_the_envelope(
    client: httpx.AsyncClient, c_guest: Callable[[str], bytes], header: str, status: int
) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "probe", c_guest("wasi_probe.c"))
    for path in ("invoke", "invocations"):
        r = await client.post(f"/v1/functions/probe/{path}", headers={**key, "X-Function-Args": header})
        assert r.status_code == status, (path, r.text)
        assert r.json()["error"]["code"] == ("bad_request" if status == 400 else "validation_error")
        assert "X-Function-Args" in r.json()["error"]["message"]
    # at the bounds exactly: accepted
    r = await _call(client, key, "probe", ["env"] + ["x"] * (MAX_ARGS - 1))
    assert r.status_code == 200 and len(_report(r.text)[0]) == MAX_ARGS + 1


@pytest.mark.parametrize("arg", [["a\x00b"], ["x" * (MAX_ARGS_BYTES + 1)], ["x"] * (MAX_ARGS + 1)], ids=["nul", "bytes", "count"])
async def test_bad_default_arguments_are_refused_and_lose_nothing(
    client: httpx.AsyncClient, c_guest: Callable[[str], bytes], arg: list[str]
) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "probe", c_guest("wasi_probe.c"), arg=["env", "kept"])
    r = await deploy(client, key, "probe", c_guest("wasi_probe.c"), arg=arg)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
    assert (await client.get("/v1/functions/probe", headers=key)).json()["args"] == ["env", "kept"]


async def test_the_environment_is_exactly_the_deployed_one(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    _, key = await new_tenant(client)
    env = {"a": "text", "b": 'escap " ing', "c": "new\nline", "PEM": "-----BEGIN-----\r\nAAA\n-----END-----\n"}
    r = await deploy(client, key, "probe", c_guest("wasi_probe.c"), env=[f"{k}={v}" for k, v in env.items()])
    assert r.status_code == 201 and r.json()["cgi"] is False, r.text
    r = await _call(client, key, "probe", params={"q": "1"}, headers={"Content-Type": "text/plain"})
    assert _report(r.text)[1] == env
    r = await deploy(client, key, "bare", c_guest("wasi_probe.c"))
    assert _report((await _call(client, key, "bare")).text)[1] == {}


async def test_cgi_adds_the_request_variables(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    tid, key = await new_tenant(client)
    tenant = (await client.get(f"/v1/admin/tenants/{tid}", headers=ADMIN)).json()["name"]
    r = await deploy(client, key, "probe", c_guest("wasi_probe.c"), env=["G=hi"], cgi="true")
    assert r.status_code == 201 and r.json()["cgi"] is True
    r = await client.post("/v1/functions/probe/invoke?a=1&b=x+y", headers={**key, "Content-Type": "text/x-test"})
    env = _report(r.text)[1]
    assert set(env) == {"G", *CGI_VARIABLES}
    assert env["QUERY_STRING"] == "a=1&b=x+y" and env["CONTENT_TYPE"] == "text/x-test"
    assert env["TW_FUNCTION"] == "probe" and env["TW_TENANT"] == tenant and env["TW_INVOCATION_ID"] == r.headers["x-invocation-id"]
    # turned off again: exactly the deployed variables
    r = await deploy(client, key, "probe", c_guest("wasi_probe.c"), cgi="false")
    assert r.json()["cgi"] is False
    assert _report((await _call(client, key, "probe")).text)[1] == {"G": "hi"}


async def test_call_arguments_reach_streamed_and_async_calls(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "probe", c_guest("wasi_probe.c"), arg=["env", "default"])
    r = await client.post("/v1/functions/probe/invoke?stream=raw", headers={**key, "X-Function-Args": '["env", "raw"]'})
    assert r.status_code == 200 and _report(r.text)[0] == ["probe", "env", "raw"]
    r = await client.post("/v1/functions/probe/invoke", headers={**key, "X-Function-Args": '["env", "sse"]', "Accept": "text/event-stream"})
    assert r.status_code == 200 and "data: arg=sse" in r.text
    r = await submit(client, key, "probe", headers={"X-Function-Args": '["env", "queued"]'})
    assert r.status_code == 202, r.text
    rec = await wait_status(client, key, r.json()["id"], "succeeded")
    out = await client.get(f"/v1/invocations/{rec['id']}/output", headers=key)
    assert _report(out.text)[0] == ["probe", "env", "queued"]
    r = await submit(client, key, "probe")  # no header: the defaults, as the function has them when it runs
    rec = await wait_status(client, key, r.json()["id"], "succeeded")
    out = await client.get(f"/v1/invocations/{rec['id']}/output", headers=key)
    assert _report(out.text)[0] == ["probe", "env", "default"]
