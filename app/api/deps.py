"""Request dependencies: the platform, a DB session, and the two kinds of caller."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.errors import ApiError
from app.observability import context as ctx
from app.platform import Platform
from app.services.api_keys import KEY_PREFIX, ApiKeyService, hash_key
from app.services.principal import TenantPrincipal


async def get_platform(request: Request) -> Platform:
    # async on purpose: FastAPI runs a plain `def` dependency in a thread, a hop on every request
    return request.app.state.platform  # type: ignore[no-any-return]


PlatformDep = Annotated[Platform, Depends(get_platform)]


async def get_session(platform: PlatformDep) -> AsyncIterator[AsyncSession]:
    async with platform.sessionmaker() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401,
            "unauthorized",
            "missing credentials: send `Authorization: Bearer <token>`",
            {"WWW-Authenticate": "Bearer"},
        )
    return token.strip()


def _is_admin(platform: Platform, token: str) -> bool:
    admin = platform.settings.admin_token or ""
    return bool(admin) and hmac.compare_digest(token.encode(), admin.encode())


async def require_admin(request: Request, platform: PlatformDep) -> None:
    token = _bearer(request)
    if _is_admin(platform, token):
        return
    if token.startswith(KEY_PREFIX) and await _tenant_for(platform, token) is not None:
        raise ApiError(403, "forbidden", "tenant API keys cannot call admin routes; use the admin token")
    raise ApiError(401, "unauthorized", "invalid admin token", {"WWW-Authenticate": "Bearer"})


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


async def require_tenant(request: Request, platform: PlatformDep) -> TenantPrincipal:
    return await authenticate_tenant(request, platform)


async def authenticate_tenant(request: Request, platform: Platform) -> TenantPrincipal:
    """The calling tenant, or 401/403 (also called directly by the invoke route)."""
    token = _bearer(request)
    principal = await _tenant_for(platform, token)
    if principal is not None:
        ctx.tenant.set(principal.name)
        return principal
    if _is_admin(platform, token):
        raise ApiError(403, "forbidden", "the admin token cannot call tenant routes; use a tenant API key")
    raise ApiError(401, "unauthorized", "invalid or revoked API key", {"WWW-Authenticate": "Bearer"})


AdminDep = Depends(require_admin)
TenantDep = Annotated[TenantPrincipal, Depends(require_tenant)]
