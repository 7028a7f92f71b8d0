"""Tenants' secrets: values sealed with the node key (app/services/sealing.py), named by the
functions that get them as environment variables. A value leaves the database only into the
environment of a call, opened in the front that sends it; never into a response, a record, a
log line, an error or a metric."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Sequence

from sqlalchemy.ext.asyncio import AsyncSession

from app.contract.messages import Principal
from app.db.models import Secret, utcnow
from app.db.repositories.secrets import SecretRepository
from app.db.repositories.tenants import TenantRepository
from app.errors import Conflict, Invalid, NotFound, Unavailable
from app.services.guest_inputs import CGI_VARIABLES, ENV_KEY
from app.services.sealing import NodeKey, Unsealable, key_mismatch

MAX_SECRET_BYTES = 64 * 1024  # of one value
MAX_FUNCTION_SECRETS = 64  # a function may name


def _aad(tenant_id: str, name: str) -> bytes:
    return f"tensorwasm secret {tenant_id}/{name}".encode()


def check_names(names: Iterable[str]) -> builtins.list[str]:
    """A deploy's `secret=` names: variable names, distinct, bounded, none the platform sets."""
    out: builtins.list[str] = []
    for name in names:
        if not ENV_KEY.fullmatch(name):
            raise Invalid(f"secret names match [A-Za-z_][A-Za-z0-9_]* (at most 128 characters), got {name[:80]!r}")
        if name in CGI_VARIABLES:
            raise Invalid(f"secret {name}: that variable is set by the platform (for functions deployed with cgi=true)")
        if name not in out:
            out.append(name)
    if len(out) > MAX_FUNCTION_SECRETS:
        raise Invalid(f"a function may get at most {MAX_FUNCTION_SECRETS} secrets")
    return sorted(out)


class SecretService:
    def __init__(self, session: AsyncSession, tenant: Principal, keys: NodeKey) -> None:
        self.session = session
        self.tenant = tenant
        self.keys = keys
        self.repo = SecretRepository(session, tenant.id)

    async def list(self) -> Sequence[Secret]:
        return await self.repo.list()

    async def put(self, name: str, value: bytes) -> tuple[Secret, bool]:
        """Keep `value` (sealed) under `name`; True if it is new. Under the tenant's lock, where
        its count and bytes are checked against max_secrets and max_secret_bytes."""
        if len(value) > MAX_SECRET_BYTES:
            raise Invalid(f"a secret's value is at most {MAX_SECRET_BYTES} bytes, got {len(value)}", code="secret_too_large")
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            text = "\x00"
        if "\x00" in text:  # the value is never quoted back, not even in part
            raise Invalid("a secret's value becomes an environment variable: UTF-8 text without NUL characters")
        tenant = await TenantRepository(self.session).lock(self.tenant.id)
        if tenant is None:
            raise NotFound.of("tenant")
        old = await self.repo.get(name)
        count, size = await self.repo.usage()
        if old is None and count + 1 > tenant.max_secrets:
            raise Conflict(
                f"the tenant keeps {count} secrets, its max_secrets quota; delete one first", code="quota_exceeded"
            )
        total = size - (old.size if old is not None else 0) + len(value)
        if total > tenant.max_secret_bytes:
            raise Conflict(
                f"this value ({len(value)} bytes) would take the tenant's secrets to {total} bytes, past its "
                f"max_secret_bytes quota of {tenant.max_secret_bytes}; delete secrets first", code="quota_exceeded",
            )
        sealed = self.keys.box().seal(value, _aad(self.tenant.id, name))
        if old is not None:
            old.ciphertext, old.size, old.updated_at = sealed, len(value), utcnow()
            await self.session.flush()
            return old, False
        return await self.repo.add(Secret(name=name, ciphertext=sealed, size=len(value))), True

    async def delete(self, name: str) -> None:
        """Refused (409 secret_in_use) while the active version of a function gets it: its
        calls would fail. Versions that are not active may name it: a rollback to one, or a
        call pinned to one, says the secret is missing."""
        if await self.repo.get(name) is None:
            raise NotFound.of(f"secret {name!r}")
        users = await self.repo.users(name)
        if users:
            listed = ", ".join(users[:10]) + (f" and {len(users) - 10} more" if len(users) > 10 else "")
            raise Conflict(
                f"secret {name!r} is given to functions {listed}; deploy them without it (or delete them) first",
                code="secret_in_use",
            )
        await self.repo.delete(name)


async def check_exist(session: AsyncSession, tenant_id: str, names: Sequence[str], what: str) -> None:
    """Every secret named must exist: a deploy or rollback naming a missing one is refused."""
    missing = sorted(set(names) - await SecretRepository(session, tenant_id).existing(names))
    if missing:
        raise Invalid(
            f"{what} gets secrets the tenant does not have: {', '.join(missing)}; create them first "
            "(PUT /v1/secrets/{name})", code="secret_not_found",
        )


async def open_secrets(session: AsyncSession, tenant_id: str, names: Sequence[str], keys: NodeKey | None, what: str) -> dict[str, str]:
    """The values of these secrets, opened for a call's environment."""
    if not names:
        return {}
    if keys is None:
        raise Unavailable("this node keeps no secrets key", code="secrets_unavailable")
    sealed = await SecretRepository(session, tenant_id).sealed(names)
    missing = sorted(set(names) - set(sealed))
    if missing:
        raise Conflict(
            f"{what} gets secrets that were deleted: {', '.join(missing)}; create them again or call another version",
            code="secret_not_found",
        )
    box = keys.box()
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = box.open(sealed[name], _aad(tenant_id, name)).decode("utf-8")
        except Unsealable:
            raise key_mismatch(f"secret {name!r}") from None
    return out
