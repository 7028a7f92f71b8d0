"""API keys: random `tw_` tokens, shown once, stored as SHA-256, compared in constant time.

Keys carry 256 random bits, so a fast hash is enough (no password stretching needed); the
prefix narrows the lookup so comparison happens against one or two rows.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from app.contract.messages import Principal
from app.db.models import ApiKey, Tenant, utcnow
from app.db.repositories.api_keys import ApiKeyRepository
from app.errors import Conflict, Forbidden, NotFound
from app.services.principal import principal_of
from app.services.shared_reads import SharedReads

KEY_PREFIX = "tw_"
PREFIX_LEN = len(KEY_PREFIX) + 8


_KEY_BODY = 43  # characters of token_urlsafe(32)
_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def key_shaped(token: str) -> bool:
    """Whether `token` could be a key this platform made: anything else needs no lookup."""
    return len(token) == len(KEY_PREFIX) + _KEY_BODY and token.startswith(KEY_PREFIX) and _KEY_CHARS.issuperset(token[len(KEY_PREFIX) :])


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def tenant_disabled() -> Forbidden:
    return Forbidden("this tenant is disabled; ask the operator to enable it", code="tenant_disabled")


class ApiKeyService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session
        self.repo = ApiKeyRepository(session)

    async def create(self, tenant_id: str) -> tuple[ApiKey, str]:
        tenant = await self.session.get(Tenant, tenant_id)
        if tenant is None:
            raise NotFound.of("tenant")
        if tenant.disabled:
            raise Conflict(f"tenant {tenant.name!r} is disabled; enable it before creating keys for it", code="tenant_disabled")
        key = generate_key()
        row = await self.repo.add(ApiKey(tenant_id=tenant_id, prefix=key[:PREFIX_LEN], key_hash=hash_key(key)))
        return row, key

    async def list(self, tenant_id: str) -> Sequence[ApiKey]:
        return await self.repo.list_for_tenant(tenant_id)

    async def revoke(self, tenant_id: str, key_id: str) -> None:
        row = await self.repo.get_for_tenant(tenant_id, key_id)
        if row is None:
            raise NotFound.of("api key")
        if row.revoked_at is None:
            row.revoked_at = utcnow()
            await self.session.flush()

    async def authenticate(self, key: str) -> tuple[str, Principal] | None:
        """The key's id and tenant; None for an unknown or revoked key; 403 `tenant_disabled`
        for a valid key of a disabled tenant (the caller should hear why, not "invalid key")."""
        if not key_shaped(key):
            return None
        digest = hash_key(key)
        for row, tenant in await self.repo.active_candidates(key[:PREFIX_LEN]):
            if hmac.compare_digest(row.key_hash, digest):
                if tenant.disabled:
                    raise tenant_disabled()
                return row.id, principal_of(tenant)
        return None


@dataclass
class _Entry:
    principal: Principal
    key_id: str
    expires: float
    last_used: float


class AuthCache:
    """Per-node cache of key -> tenant so the invoke path does not hit the database.

    Admin changes on this node invalidate it at once; other nodes converge within the TTL.
    Keys used recently are re-read in the background before they expire (`refresh`), so a
    tenant calling now and then does not pay the lookup on the call.
    """

    def __init__(self, ttl_s: float, max_missing: int = 100_000) -> None:
        self.ttl_s = ttl_s
        # bumped by every change made here: a read begun before one is neither kept nor shared after it
        self.generation = 0
        self.reads: SharedReads[tuple[str, int], Principal | None] = SharedReads()  # by (digest, generation)
        self._entries: dict[str, _Entry] = {}
        # digests looked up and not found, until when: a repeated bad key costs no lookup
        self._missing: OrderedDict[str, float] = OrderedDict()
        self._max_missing = max_missing

    def is_missing(self, digest: str) -> bool:
        until = self._missing.get(digest)
        if until is None:
            return False
        if until < time.monotonic():
            del self._missing[digest]
            return False
        return True

    def put_missing(self, digest: str) -> None:
        self._missing[digest] = time.monotonic() + self.ttl_s
        self._missing.move_to_end(digest)
        if len(self._missing) > self._max_missing:
            self._missing.popitem(last=False)

    def get(self, digest: str) -> Principal | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        now = time.monotonic()
        if entry.expires < now:
            return None
        entry.last_used = now
        return entry.principal

    def put(self, digest: str, key_id: str, principal: Principal) -> None:
        if len(self._entries) > 10_000:
            self._entries.clear()
        now = time.monotonic()
        self._entries[digest] = _Entry(principal, key_id, now + self.ttl_s, now)

    def clear(self) -> None:
        self.generation += 1
        self._entries.clear()
        self._missing.clear()

    async def refresh(self, session: AsyncSession, keep_s: float) -> None:
        """Re-read every key used within `keep_s` in one query; forget the rest, and any key
        revoked or whose tenant was disabled or deleted meanwhile."""
        now = time.monotonic()
        kept = {d: e for d, e in self._entries.items() if now - e.last_used <= keep_s}
        tenants = await ApiKeyRepository(session).active_tenants([e.key_id for e in kept.values()])
        expires = time.monotonic() + self.ttl_s
        for digest, entry in kept.items():
            tenant = tenants.get(entry.key_id)
            if tenant is None:
                self._entries.pop(digest, None)
            elif self._entries.get(digest) is entry:  # not replaced while we read
                entry.principal, entry.expires = principal_of(tenant), expires
        for digest in [d for d in self._entries if d not in kept]:
            if now - self._entries[digest].last_used > keep_s:
                del self._entries[digest]
