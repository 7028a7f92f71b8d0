"""Request dependencies: the platform, a DB session, and the two kinds of caller."""

from __future__ import annotations

import hmac
import ipaddress
import math
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.errors import ApiError
from app.contract.messages import Principal
from app.observability import context as ctx
from app.platform import Platform
from app.services.api_keys import ApiKeyService, hash_key, key_shaped
from app.services.auth_failures import address_key


async def get_platform(request: Request) -> Platform:
    # async on purpose: FastAPI runs a plain `def` dependency in a thread, a hop on every request
    return request.app.state.platform


PlatformDep = Annotated[Platform, Depends(get_platform)]


async def get_session(platform: PlatformDep) -> AsyncIterator[AsyncSession]:
    async with platform.sessionmaker() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


# Two bearer schemes in the OpenAPI document, so /docs can hold both tokens and send each to its
# routes. Parsing stays ours (auto_error off) to answer in the error envelope.
admin_bearer = HTTPBearer(
    scheme_name="AdminToken", description="the operator's token (TENSORWASM_ADMIN_TOKEN)", auto_error=False
)
tenant_bearer = HTTPBearer(
    scheme_name="ApiKey", description="a tenant API key (`tw_...`) made by the admin API", auto_error=False
)
# The invoke route resolves its caller without dependencies; it declares the scheme with this.
TENANT_SECURITY: list[dict[str, list[str]]] = [{"ApiKey": []}]


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})


def _failed(platform: Platform, address: str, message: str = "invalid or revoked API key") -> ApiError:
    """A failed authentication, charged to its address."""
    platform.auth_failures.failed(address)
    platform.metrics.auth_failed(throttled=False)
    return _unauthorized(message)


def _too_many_failures(platform: Platform, wait_s: float) -> ApiError:
    platform.metrics.auth_failed(throttled=True)
    s = platform.settings
    return ApiError(
        429, "too_many_auth_failures",
        f"too many failed authentications from this address (at most {s.auth_failures_per_s:g} a second after a burst of "
        f"{s.auth_failure_burst}); wait and check the credentials",
        {"Retry-After": str(max(1, math.ceil(wait_s)))},
    )


_MISSING = "missing credentials: send `Authorization: Bearer <token>`"
Credentials = HTTPAuthorizationCredentials | None


def _token(header: bytes) -> str | None:
    scheme, _, token = header.decode("latin-1").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _bearer(header: bytes) -> str:
    token = _token(header)
    if token is None:
        raise _unauthorized(_MISSING)
    return token


def _is_admin(platform: Platform, token: str) -> bool:
    admin = platform.settings.admin_token or ""
    return bool(admin) and hmac.compare_digest(token.encode(), admin.encode())


async def _tenant_for(platform: Platform, token: str, address: str) -> Principal | None:
    """The key's tenant; None for a key that is not one. Only a key-shaped token not seen
    lately (found or missing) is looked up, and only while its address may still fail."""
    if not key_shaped(token):
        return None
    digest = hash_key(token)
    cache = platform.auth_cache
    principal = cache.get(digest)
    if principal is not None:
        return principal
    if cache.is_missing(digest):
        return None
    wait_s = platform.auth_failures.wait_s(address)
    if wait_s:
        raise _too_many_failures(platform, wait_s)
    generation = cache.generation
    return await cache.reads.read((digest, generation), lambda: _read_key(platform, token, digest, generation))


async def _read_key(platform: Platform, token: str, digest: str, generation: int) -> Principal | None:
    """The key's tenant from the database (one read for the calls that bring the key meanwhile),
    kept in the auth cache unless an admin change here came during the read."""
    async with platform.sessionmaker() as session:
        found = await ApiKeyService(session).authenticate(token)
    cache = platform.auth_cache
    if found is None:
        if cache.generation == generation:
            cache.put_missing(digest)
        return None
    key_id, principal = found
    platform.recorder.touch_key(key_id, platform.clock())
    if cache.generation == generation:
        cache.put(digest, key_id, principal)
    return principal


def _digest(header: bytes) -> str | None:
    """The auth cache's key for an Authorization header; None: no key this platform made."""
    token = _token(header)
    if token is None or not key_shaped(token):
        return None
    return hash_key(token)


# The same, kept per header seen lately: parsed, checked and hashed on every call it cost the
# front 1.4-1.9 µs a call on the 2-core dev VM, a lookup here 0.1-0.2. A pure function of the
# header (revoking a key or disabling its tenant acts on the auth cache's entry, not here), held
# only for headers of at most _SEEN_MAX bytes (a key's is 53), so 4096 of them stay small.
_SEEN_MAX = 128
_digest_seen = lru_cache(maxsize=4096)(_digest)


def cached_tenant(platform: Platform, header: bytes) -> Principal | None:
    """The calling tenant when its key is in the auth cache: a caller's usual request, answered
    without awaiting anything. None: `admit_tenant` looks the key up, or refuses it."""
    digest = _digest_seen(header) if len(header) <= _SEEN_MAX else _digest(header)
    if digest is None:
        return None
    principal = platform.auth_cache.get(digest)
    if principal is not None:
        ctx.tenant.set(principal.name)
    return principal


async def admit_admin(platform: Platform, header: bytes, host: str | None) -> None:
    """The admin token, or 401 (403 for a tenant key; 429 for an address failing too often)."""
    token = _bearer(header)
    if _is_admin(platform, token):
        return
    address = address_key(host)
    wait_s = platform.auth_failures.wait_s(address)
    if wait_s:
        raise _too_many_failures(platform, wait_s)
    if await _tenant_for(platform, token, address) is not None:
        raise ApiError(403, "forbidden", "tenant API keys cannot call admin routes; use the admin token")
    raise _failed(platform, address, "invalid admin token")


async def admit_tenant(platform: Platform, header: bytes, host: str | None) -> Principal:
    """The calling tenant, or 401 (403 for the admin token or a disabled tenant; 429 for an
    address failing too often)."""
    token = _bearer(header)
    address = address_key(host)
    principal = await _tenant_for(platform, token, address)
    if principal is not None:
        ctx.tenant.set(principal.name)
        return principal
    if _is_admin(platform, token):
        raise ApiError(403, "forbidden", "the admin token cannot call tenant routes; use a tenant API key")
    raise _failed(platform, address)


async def admit_metrics(platform: Platform, header: bytes, host: str | None) -> None:
    """/metrics names every tenant in its labels: with a metrics token set it needs that token;
    without one it answers loopback callers (or everyone, with TENSORWASM_METRICS_PUBLIC), and
    others must send the admin token. Failures count against the address like any other."""
    settings = platform.settings
    if not settings.metrics_token and (settings.metrics_public or _loopback(host)):
        return
    address = address_key(host)
    wait_s = platform.auth_failures.wait_s(address)
    if wait_s:
        raise _too_many_failures(platform, wait_s)
    token = header.decode("latin-1").removeprefix("Bearer ").strip()
    expected = settings.metrics_token or settings.admin_token or ""
    if expected and hmac.compare_digest(token.encode(), expected.encode()):
        return
    if settings.metrics_token:
        raise _failed(platform, address, "send `Authorization: Bearer <metrics token>`")
    raise _failed(
        platform, address, "/metrics answers other hosts with a token: send `Authorization: Bearer <admin token>`, or set TENSORWASM_METRICS_TOKEN"
    )


def _loopback(host: str | None) -> bool:
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def _header(request: Request) -> bytes:
    return request.headers.get("authorization", "").encode("latin-1")


def _host(request: Request) -> str | None:
    return request.client.host if request.client else None


# The routes' dependencies: the gate (app/api/gate.py) has admitted the caller before the body;
# these read what it found, and check again only where no gate ran.
async def require_admin(request: Request, platform: PlatformDep, _: Annotated[Credentials, Depends(admin_bearer)]) -> None:
    if not request.scope.get("state", {}).get("admin"):
        await admit_admin(platform, _header(request), _host(request))


async def require_tenant(request: Request, platform: PlatformDep, _: Annotated[Credentials, Depends(tenant_bearer)]) -> Principal:
    return await authenticate_tenant(request, platform)


async def authenticate_tenant(request: Request, platform: Platform) -> Principal:
    """The calling tenant (the invoke route resolves it with this, without dependencies)."""
    principal: Principal | None = request.scope.get("state", {}).get("principal")
    if principal is not None:
        ctx.tenant.set(principal.name)
        return principal
    return await admit_tenant(platform, _header(request), _host(request))


AdminDep = Depends(require_admin)
TenantDep = Annotated[Principal, Depends(require_tenant)]
