"""Callbacks of async invocations: an invocation submitted with X-Callback-Url is POSTed, once it
ended, to that URL as its final record (JSON), signed with its tenant's signing secret.

Signature: `X-TensorWasm-Signature: t=<unix seconds>,sha256=<hex HMAC-SHA256 of "<t>." + body>`
(the same t is in `X-TensorWasm-Timestamp`), keyed with the secret of `GET /v1/callbacks/secret`.
A 2xx answer delivers it; anything else (or no answer within TENSORWASM_CALLBACK_TIMEOUT_S) is
tried again after TENSORWASM_CALLBACK_BACKOFF_S, doubling up to TENSORWASM_CALLBACK_BACKOFF_MAX_S,
until TENSORWASM_CALLBACK_RETRY_S after the first attempt: then it is `failed`. Redirects are not
followed. Loopback, private, link-local and other non-public addresses are refused at the submit
and at every attempt (the name may resolve elsewhere by then) unless
TENSORWASM_CALLBACK_ALLOW_PRIVATE is set.

Deliveries are rows of the database written with their invocation: a dispatcher on every node
(next to its queue runner, never inside it) takes due ones, one node per attempt, so a delivery
survives a restart and is sent by whichever node is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.contract.messages import Principal
from app.db.models import CallbackDelivery, Invocation
from app.db.repositories.callbacks import CallbackRepository
from app.db.repositories.invocations import InvocationRepository
from app.errors import Invalid, Unavailable
from app.observability.metrics import Metrics
from app.queue.states import InvocationStatus
from app.services.sealing import NodeKey, Unsealable, key_mismatch
from app.settings import Settings

log = logging.getLogger(__name__)

MAX_URL = 2048
SIGNATURE_HEADER = "X-TensorWasm-Signature"
TIMESTAMP_HEADER = "X-TensorWasm-Timestamp"
_ENDED = [s.value for s in InvocationStatus if s.ended]

Clock = Callable[[], datetime]
# the body of a callback: the invocation's final record as the API shows it, with its callback
Render = Callable[[Invocation, CallbackDelivery], bytes]


class CallbackStatus(StrEnum):
    PENDING = "pending"  # not yet delivered: waiting for the end, or for its next attempt
    DELIVERED = "delivered"
    FAILED = "failed"  # every attempt within TENSORWASM_CALLBACK_RETRY_S failed


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},sha256={mac}"


def verify(secret: str, header: str, body: bytes, *, tolerance_s: float = 300, now: float | None = None) -> bool:
    """What a receiver does (the README shows the same in a few lines)."""
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        t = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs((now if now is not None else time.time()) - t) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, t, body), f"t={t},sha256={fields.get('sha256', '')}")


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def check_url(url: str, allow_private: bool) -> str:
    """The callback URL, or Invalid (422) saying why it is refused."""
    url = url.strip()
    if len(url) > MAX_URL:
        raise Invalid(f"X-Callback-Url is longer than {MAX_URL} characters", code="invalid_callback_url")
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port
    except ValueError as exc:
        raise Invalid(f"X-Callback-Url is not a valid URL ({exc})", code="invalid_callback_url") from None
    if parts.scheme not in ("http", "https") or not host:
        raise Invalid("X-Callback-Url must be an http:// or https:// URL with a host", code="invalid_callback_url")
    if parts.username or parts.password:
        raise Invalid("X-Callback-Url must not carry credentials; verify callbacks by their signature instead", code="invalid_callback_url")
    if allow_private:
        return url
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or (443 if parts.scheme == "https" else 80), type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Invalid(f"the host of X-Callback-Url, {host!r}, does not resolve ({exc.strerror or exc})", code="invalid_callback_url") from None
    private = sorted({str(info[4][0]) for info in infos if not _public(str(info[4][0]))})
    if private:
        raise Invalid(
            f"X-Callback-Url's host {host!r} is (or resolves to) a loopback, private or otherwise non-public address "
            f"({', '.join(private)}): callbacks go to public addresses only on this platform (an operator may allow "
            "others with TENSORWASM_CALLBACK_ALLOW_PRIVATE)",
            code="callback_url_not_allowed",
        )
    return url


def new_delivery(invocation_id: str, tenant_id: str, url: str, now: datetime) -> CallbackDelivery:
    return CallbackDelivery(
        invocation_id=invocation_id, tenant_id=tenant_id, url=url, status=CallbackStatus.PENDING.value, attempts=0, next_attempt_at=now,
    )


def new_secret() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class SigningSecret:
    """A tenant's callback signing secret, opened."""

    value: str
    created_at: datetime


def _aad(tenant_id: str) -> bytes:
    return f"tensorwasm callback secret {tenant_id}".encode()


class CallbackSecrets:
    """Each tenant's signing secret: made at its first use, replaced by a rotation, kept sealed
    with the node key (app/services/sealing.py) like the tenants' own secrets. One written
    before secrets were sealed is sealed at its first read."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], clock: Clock, keys: NodeKey) -> None:
        self.sessionmaker = sessionmaker
        self.clock = clock
        self.keys = keys

    def _open(self, tenant_id: str, sealed: bytes) -> str:
        try:
            return self.keys.box().open(sealed, _aad(tenant_id)).decode("utf-8")
        except Unsealable:
            raise key_mismatch("the callback signing secret", "ask the operator (or rotate the secret)") from None

    def _seal(self, tenant_id: str, value: str) -> bytes:
        return self.keys.box().seal(value.encode("utf-8"), _aad(tenant_id))

    async def get(self, tenant_id: str) -> SigningSecret:
        for _ in range(3):  # a few tries: each loses only to a writer that changed the row meanwhile
            async with self.sessionmaker() as session:
                repo = CallbackRepository(session)
                row = await repo.secret(tenant_id)
                if row is not None and row.ciphertext is not None:
                    return SigningSecret(self._open(tenant_id, row.ciphertext), row.created_at)
                if row is not None and row.secret:  # written in clear by an older version: sealed now
                    value, created = row.secret, row.created_at
                    # only while the row still holds that value: a rotation that committed since
                    # is never undone
                    if await repo.seal_clear_secret(tenant_id, value, self._seal(tenant_id, value)):
                        await session.commit()
                        return SigningSecret(value, created)
                    continue
                value = new_secret()
                try:
                    row = await repo.put_secret(tenant_id, self._seal(tenant_id, value), self.clock())
                    await session.commit()
                    return SigningSecret(value, row.created_at)
                except IntegrityError:  # made at the same moment elsewhere: read that one
                    await session.rollback()
        raise Unavailable("the callback signing secret was changed by other writers at every try; retry", retry_after=1)

    async def rotate(self, tenant: Principal) -> SigningSecret:
        value = new_secret()
        async with self.sessionmaker() as session:
            row = await CallbackRepository(session).put_secret(tenant.id, self._seal(tenant.id, value), self.clock())
            await session.commit()
            return SigningSecret(value, row.created_at)


class CallbackDispatcher:
    """Sends due callbacks, at most TENSORWASM_CALLBACK_CONCURRENCY at once, in tasks of its own."""

    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings, clock: Clock, metrics: Metrics, render: Render,
        signing: CallbackSecrets, write_lock: contextlib.AbstractAsyncContextManager[Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.settings = settings
        self.clock = clock
        self.metrics = metrics
        self.render = render
        self.write_lock = write_lock or contextlib.nullcontext()  # SQLite: the queue's writes take turns
        self.secrets = signing
        self._http = httpx.AsyncClient(timeout=settings.callback_timeout_s, follow_redirects=False, transport=transport)
        self._wake = asyncio.Event()
        self._sending: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Attempts in flight are abandoned: their claims lapse and another node (or this one
        after its restart) sends them again."""
        tasks = [t for t in (self._task, *self._sending) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self._http.aclose()

    def wake(self, invocation_id: str = "") -> None:
        """An invocation ended on this node: look now rather than at the next poll."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.callback_poll_s)
            self._wake.clear()
            try:
                await self.dispatch()
            except Exception:
                log.exception("looking for due callbacks failed; will retry")

    async def dispatch(self) -> int:
        """Claim due deliveries while there is room and start sending them; returns how many."""
        room = self.settings.callback_concurrency - len(self._sending)
        if room <= 0:
            return 0
        now = self.clock()
        claim_until = now + timedelta(seconds=self.settings.callback_timeout_s + 30)
        claimed: list[CallbackDelivery] = []
        async with self.write_lock, self.sessionmaker() as session:
            repo = CallbackRepository(session)
            for d in await repo.due(now, _ENDED, room):
                if await repo.claim(d.invocation_id, d.next_attempt_at, claim_until):
                    claimed.append(d)
            await session.commit()
        for d in claimed:
            task = asyncio.get_running_loop().create_task(self._attempt(d.invocation_id))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return len(claimed)

    async def _attempt(self, invocation_id: str) -> None:
        d: CallbackDelivery | None = None
        first = self.clock()
        code: int | None
        error: str | None
        try:
            async with self.sessionmaker() as session:
                d = await session.get(CallbackDelivery, invocation_id)
                inv = await InvocationRepository(session, d.tenant_id).get(invocation_id, data=False) if d else None
            if d is None or inv is None:
                return  # its invocation or tenant was deleted meanwhile
            first = d.first_attempt_at or first
            try:
                secret = (await self.secrets.get(d.tenant_id)).value
            except Unavailable as exc:  # nothing to sign with on this node (its secrets key is not the cluster's)
                code, error = None, f"{exc.code}: {exc.message}"[:1000]
            else:
                code, error = await self._post(d, inv, secret)
        except Exception as exc:  # never lose the delivery to a bug: it is tried again like a failed POST
            log.exception("sending the callback of invocation %s failed", invocation_id)
            code, error = None, f"internal error: {type(exc).__name__}"
        now = self.clock()
        attempts = (d.attempts if d else 0) + 1
        values: dict[str, Any] = {"attempts": attempts, "last_status_code": code, "last_error": error, "first_attempt_at": first}
        if code is not None and 200 <= code < 300:
            values.update(status=CallbackStatus.DELIVERED.value, delivered_at=now, last_error=None)
            outcome = "delivered"
        else:
            wait = min(self.settings.callback_backoff_s * 2 ** (attempts - 1), self.settings.callback_backoff_max_s)
            if now + timedelta(seconds=wait) > first + timedelta(seconds=self.settings.callback_retry_s):
                values.update(status=CallbackStatus.FAILED.value)
                outcome = "failed"
                log.info("the callback of invocation %s failed after %d attempts: %s", invocation_id, attempts, error)
            else:
                values.update(next_attempt_at=now + timedelta(seconds=wait))
                outcome = "retried"
        if d is None:
            values.pop("attempts")
        async with self.write_lock, self.sessionmaker() as session:
            await CallbackRepository(session).set(invocation_id, values)
            await session.commit()
        self.metrics.callbacks.labels(outcome).inc()

    async def _post(self, d: CallbackDelivery, inv: Invocation, secret: str) -> tuple[int | None, str | None]:
        """One POST; (its status, None) or (None, why there was no answer)."""
        try:
            await check_url(d.url, self.settings.callback_allow_private)  # the name may resolve elsewhere now
        except Invalid as exc:
            return None, exc.message
        # the record shows this attempt among its attempts
        shown = CallbackDelivery(**{c: getattr(d, c) for c in ("invocation_id", "tenant_id", "url", "status", "first_attempt_at",
                                                               "last_status_code", "last_error", "delivered_at")})
        shown.attempts = d.attempts + 1
        body = self.render(inv, shown)
        t = int(time.time())
        headers = {
            "Content-Type": "application/json", SIGNATURE_HEADER: sign(secret, t, body), TIMESTAMP_HEADER: str(t),
            "X-Invocation-Id": inv.id, "User-Agent": "tensorwasm-callbacks",
        }
        try:
            r = await self._http.post(d.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:1000] or type(exc).__name__
        return r.status_code, None if r.is_success else f"answered {r.status_code}"
