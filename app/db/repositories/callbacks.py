"""Callback deliveries and tenants' callback signing secrets (app/services/callbacks.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import CallbackDelivery, CallbackSecret, Invocation

PENDING = "pending"  # app.services.callbacks.CallbackStatus.PENDING; a repository knows values, not the enum's module


class CallbackRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def add(self, delivery: CallbackDelivery) -> None:
        self.session.add(delivery)
        await self.session.flush()

    async def of(self, tenant_id: str, invocation_ids: Sequence[str]) -> dict[str, CallbackDelivery]:
        if not invocation_ids:
            return {}
        q = select(CallbackDelivery).where(CallbackDelivery.tenant_id == tenant_id, CallbackDelivery.invocation_id.in_(list(invocation_ids)))
        return {d.invocation_id: d for d in (await self.session.scalars(q)).all()}

    async def due(self, now: datetime, ended: Sequence[str], limit: int) -> Sequence[CallbackDelivery]:
        """Pending deliveries whose time came and whose invocation ended, oldest first."""
        q = (
            select(CallbackDelivery)
            .join(Invocation, Invocation.id == CallbackDelivery.invocation_id)
            .where(CallbackDelivery.status == PENDING, CallbackDelivery.next_attempt_at <= now, Invocation.status.in_(list(ended)))
            .order_by(CallbackDelivery.next_attempt_at).limit(limit)
        )
        return (await self.session.scalars(q)).all()

    async def claim(self, invocation_id: str, seen_next: datetime, until: datetime) -> bool:
        """Take a due delivery for one attempt: its next time moves to `until`, so no other node
        sends it meanwhile; False when another node took it first."""
        result = await self.session.execute(
            update(CallbackDelivery)
            .where(CallbackDelivery.invocation_id == invocation_id, CallbackDelivery.status == PENDING,
                   CallbackDelivery.next_attempt_at == seen_next)
            .values(next_attempt_at=until)
        )
        return bool(getattr(result, "rowcount", 0))

    async def set(self, invocation_id: str, values: dict[str, Any]) -> None:
        await self.session.execute(update(CallbackDelivery).where(CallbackDelivery.invocation_id == invocation_id).values(**values))

    # -- signing secrets ------------------------------------------------------------------------
    async def secret(self, tenant_id: str) -> CallbackSecret | None:
        return await self.session.get(CallbackSecret, tenant_id)

    async def seal_clear_secret(self, tenant_id: str, value: str, sealed: bytes) -> bool:
        """Replace a secret held in clear by its sealed form, if the row still holds `value` in
        clear; False when another writer changed it first."""
        res = await self.session.execute(
            update(CallbackSecret)
            .where(CallbackSecret.tenant_id == tenant_id, CallbackSecret.ciphertext.is_(None), CallbackSecret.secret == value)
            .values(ciphertext=sealed, secret=None)
            .execution_options(synchronize_session=False)
        )
        return bool(res.rowcount)  # type: ignore[attr-defined]

    async def put_secret(self, tenant_id: str, sealed: bytes, now: datetime) -> CallbackSecret:
        row = await self.session.get(CallbackSecret, tenant_id)
        if row is None:
            row = CallbackSecret(tenant_id=tenant_id, ciphertext=sealed, created_at=now)
            self.session.add(row)
        else:
            row.ciphertext, row.secret, row.created_at = sealed, None, now
        await self.session.flush()
        return row
