"""Request dependencies: the platform, a DB session, and the two kinds of caller."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.errors import ApiError
from app.observability import context as ctx
from app.platform import Platform
from app.services.api_keys import KEY_PREFIX, ApiKeyService, hash_key
from app.services.principal import TenantPrincipal


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


_MISSING = "missing credentials: send `Authorization: Bearer <token>`"
Credentials = HTTPAuthorizationCredentials | None


def _token(credentials: Credentials) -> str:
    if credentials is None or not credentials.credentials.strip():
        raise _unauthorized(_MISSING)
    return credentials.credentials.strip()


def _bearer(request: Request) -> str:
    """The token, parsed by hand for the invoke route (no dependencies on the hot path)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized(_MISSING)
    return token.strip()


def _is_admin(platform: Platform, token: str) -> bool:
    admin = platform.settings.admin_token or ""
    return bool(admin) and hmac.compare_digest(token.encode(), admin.encode())


async def require_admin(platform: PlatformDep, credentials: Annotated[Credentials, Depends(admin_bearer)]) -> None:
    token = _token(credentials)
    if _is_admin(platform, token):
        return
    if token.startswith(KEY_PREFIX) and await _tenant_for(platform, token) is not None:
        raise ApiError(403, "forbidden", "tenant API keys cannot call admin routes; use the admin token")
    raise _unauthorized("invalid admin token")


async def _tenant_for(platform: Platform, token: str) -> TenantPrincipal | None:
    digest = hash_key(token)
    principal = platform.auth_cache.get(digest)
    if principal is not None:
        return principal
    async with platform.sessionmaker() as session:
        found = await ApiKeyService(session).authenticate(token)
        if found is None:
            return None
        key_id, principal = found
    platform.recorder.touch_key(key_id, platform.clock())
    platform.auth_cache.put(digest, key_id, principal)
    return principal


async def require_tenant(platform: PlatformDep, credentials: Annotated[Credentials, Depends(tenant_bearer)]) -> TenantPrincipal:
    return await _tenant_or_error(platform, _token(credentials))


async def authenticate_tenant(request: Request, platform: Platform) -> TenantPrincipal:
    """The calling tenant, or 401/403, for the invoke route (which uses no dependencies)."""
    return await _tenant_or_error(platform, _bearer(request))


async def _tenant_or_error(platform: Platform, token: str) -> TenantPrincipal:
    principal = await _tenant_for(platform, token)
    if principal is not None:
        ctx.tenant.set(principal.name)
        return principal
    if _is_admin(platform, token):
        raise ApiError(403, "forbidden", "the admin token cannot call tenant routes; use a tenant API key")
    raise _unauthorized("invalid or revoked API key")


AdminDep = Depends(require_admin)
TenantDep = Annotated[TenantPrincipal, Depends(require_tenant)]
