"""Domain errors (app/errors.py) and their one mapping to HTTP (app/api/errors.py): every kind has
a status, and services' errors reach clients with the status, code, message and Retry-After
they always had."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

import app.errors
import app.main  # noqa: F401  (imports every module that may define a DomainError)
from app.api.errors import DOMAIN_STATUS, domain_status, install_error_handlers, not_found
from app.db.models import utcnow
from app.errors import Conflict, DomainError, Forbidden, Gone, Invalid, LimitReached, NotFound, Unavailable
from app.runtime.compiler import CompilerUnavailable
from tests.helpers import ADMIN, deploy, new_tenant, submit, wait_status, wat

KINDS = [cls for cls in vars(app.errors).values() if inspect.isclass(cls) and issubclass(cls, DomainError) and cls is not DomainError]


def _all_subclasses(cls: type[DomainError]) -> Iterator[type[DomainError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


# -- the errors and the status table ---------------------------------------------------------------


def test_every_kind_has_a_status_in_the_table() -> None:
    assert KINDS, "app/errors.py defines no kinds"
    missing = [cls.__name__ for cls in KINDS if cls not in DOMAIN_STATUS]
    assert not missing, f"DomainError kinds without a status in app/api/errors.py DOMAIN_STATUS: {missing}"
    assert set(DOMAIN_STATUS) == set(KINDS)  # and the table names nothing else
    assert DOMAIN_STATUS == {NotFound: 404, Conflict: 409, Forbidden: 403, Invalid: 422, LimitReached: 429, Gone: 410, Unavailable: 503}


def test_every_domain_error_in_the_app_resolves_to_a_status() -> None:
    # a subclass of a kind defined anywhere (e.g. a service's own NotFound) answers its kind's status
    for cls in _all_subclasses(DomainError):
        if cls.__module__.startswith("app."):
            assert domain_status(cls("x")) is not None, f"{cls.__module__}.{cls.__name__} maps to no status"


def test_a_subclass_of_a_kind_takes_the_kinds_status_and_a_bare_one_none() -> None:
    class MissingThing(NotFound):
        pass

    assert domain_status(MissingThing("x")) == 404
    assert domain_status(DomainError("x")) is None


def test_codes_default_per_kind_and_are_overridden_per_instance() -> None:
    defaults = {cls: cls("x").code for cls in KINDS}
    assert defaults == {
        NotFound: "not_found", Conflict: "conflict", Forbidden: "forbidden", Invalid: "validation_error",
        LimitReached: "rate_limited", Gone: "expired", Unavailable: "unavailable",
    }
    err = Invalid("bad", code="module_too_complex")
    assert (err.code, err.message, str(err), err.retry_after) == ("module_too_complex", "bad", "bad", None)
    assert Invalid("x").code == "validation_error"  # the override did not touch the class
    assert LimitReached("full", code="queue_full", retry_after=1).retry_after == 1


def test_not_found_of_says_what_as_api_not_found_did() -> None:
    err = NotFound.of("tenant")
    assert type(err) is NotFound and err.code == "not_found" and err.message == "tenant not found"
    assert err.message == not_found("tenant").message
    assert NotFound.of("function 'f'").message == "function 'f' not found"


# -- the handler, per kind, on an app of its own ---------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("retry_after", [None, 7])
async def test_the_handler_answers_each_kinds_status_code_message_and_retry_after(kind: type[DomainError], retry_after: int | None) -> None:
    api = FastAPI()
    install_error_handlers(api)

    @api.get("/boom")
    async def boom() -> None:
        raise kind("what went wrong; what to do", code="some_code", retry_after=retry_after)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://t") as client:
        r = await client.get("/boom")
    assert r.status_code == DOMAIN_STATUS[kind]
    assert r.json() == {"error": {"code": "some_code", "message": "what went wrong; what to do"}}
    assert r.headers.get("retry-after") == (None if retry_after is None else str(retry_after))


async def test_a_domain_error_of_no_kind_is_an_internal_error() -> None:
    api = FastAPI()
    install_error_handlers(api)

    @api.get("/boom")
    async def boom() -> None:
        raise DomainError("no kind")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://t") as client:
        r = await client.get("/boom")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal"


# -- through the real routes: what services raise, as clients see it -------------------------------


def _error(r: httpx.Response) -> tuple[int, str, str, str | None]:
    body = r.json()
    return r.status_code, body["error"]["code"], body["error"]["message"], r.headers.get("retry-after")


async def test_not_found_routed_and_on_the_fast_path(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    assert _error(await client.get("/v1/functions/missing", headers=key)) == (404, "not_found", "function 'missing' not found", None)
    # the invoke fast path picks the DomainError handler by the exception's MRO
    r = await client.post("/v1/functions/missing/invoke", content=b"x", headers=key)
    assert _error(r) == (404, "not_found", "function 'missing' not found", None)
    assert _error(await client.get("/v1/kernels/nope", headers=key)) == (404, "not_found", "kernel module 'nope' not found", None)
    r = await client.get("/v1/admin/tenants/00000000000000000000000000000000", headers=ADMIN)
    assert _error(r) == (404, "not_found", "no tenant with the id or name '00000000000000000000000000000000'", None)


async def test_conflict_for_a_taken_tenant_name(client: httpx.AsyncClient) -> None:
    tid, _ = await new_tenant(client)
    name = (await client.get(f"/v1/admin/tenants/{tid}", headers=ADMIN)).json()["name"]
    r = await client.post("/v1/admin/tenants", json={"name": name}, headers=ADMIN)
    assert _error(r) == (409, "conflict", f"a tenant named {name!r} already exists", None)


async def test_a_disabled_tenant_is_forbidden_and_its_keys_conflict(client: httpx.AsyncClient) -> None:
    tid, key = await new_tenant(client)
    name = (await client.get(f"/v1/admin/tenants/{tid}", headers=ADMIN)).json()["name"]
    assert (await client.patch(f"/v1/admin/tenants/{tid}", json={"disabled": True}, headers=ADMIN)).status_code == 200
    try:
        r = await client.get("/v1/functions", headers=key)
        assert _error(r) == (403, "tenant_disabled", "this tenant is disabled; ask the operator to enable it", None)
        r = await client.post(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)
        assert _error(r) == (409, "tenant_disabled", f"tenant {name!r} is disabled; enable it before creating keys for it", None)
    finally:
        await client.patch(f"/v1/admin/tenants/{tid}", json={"disabled": False}, headers=ADMIN)


async def test_conflict_when_the_function_quota_is_used(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, max_functions=1)
    assert (await deploy(client, key, "f1", wat("noop"))).status_code == 201
    r = await deploy(client, key, "f2", wat("noop"))
    assert _error(r) == (409, "quota_exceeded", "the tenant may deploy at most 1 functions; delete one first", None)


async def test_invalid_module_and_settings(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, timeout_ms=1000)
    status, code, _, retry = _error(await deploy(client, key, "junk", b"not wasm at all"))
    assert (status, code, retry) == (422, "invalid_module", None)
    r = await deploy(client, key, "f", wat("noop"), timeout_ms=2000)
    assert _error(r) == (422, "validation_error", "timeout_ms must be between 1 and the tenant quota (1000 ms)", None)
    r = await client.put("/v1/kernels/std", content=b"x", headers={**key, "Content-Type": "text/plain"})
    assert _error(r) == (409, "conflict", "`std` is the platform's kernel library; choose another name", None)


async def test_unavailable_compiler_is_503_with_retry_after_5(client: httpx.AsyncClient, platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, key = await new_tenant(client)

    async def compile(tenant_id: str, wasm: bytes) -> Any:
        raise CompilerUnavailable("the compile sandbox could not start")

    monkeypatch.setattr(platform.compiler, "compile", compile)
    r = await deploy(client, key, "f", wat("noop"))
    assert _error(r) == (503, "unavailable", "the compile sandbox could not start; retry later", "5")


async def test_a_full_queue_is_429_queue_full_with_retry_after_1(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, max_queued=0)
    assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201
    r = await submit(client, key, "echo")
    assert _error(r) == (
        429, "queue_full",
        "the tenant has 0 async invocations waiting to start (its max_queued quota is 0); retry once some have started", "1",
    )


async def test_an_expired_output_is_410_gone(client: httpx.AsyncClient, platform: Any) -> None:
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201
    inv = (await submit(client, key, "echo", b"x")).json()["id"]
    await wait_status(client, key, inv, "succeeded")
    real = platform.queue.clock
    retention = platform.settings.output_retention_s

    def later() -> datetime:
        return utcnow() + timedelta(seconds=retention + 1)

    platform.queue.clock = later
    try:
        r = await client.get(f"/v1/invocations/{inv}/output", headers=key)
    finally:
        platform.queue.clock = real
    assert _error(r) == (410, "expired", f"the output was deleted after the retention of {retention:g} s; the record remains", None)
