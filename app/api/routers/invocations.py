from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.errors import ApiError, error_responses, not_found
from app.api.media import safe_media_type
from app.api.schemas import ID_PATTERN, NAME_PATTERN, CallbackOut, InvocationOut, InvocationPage, LostAttemptOut
from app.api.streaming import StoredOutputResponse
from app.db.models import OUTPUT_SLICE, CallbackDelivery, Invocation
from app.db.repositories.callbacks import CallbackRepository
from app.db.repositories.invocations import InvocationRepository
from app.queue.states import InvocationMode, InvocationStatus
from app.services.callbacks import CallbackStatus
from app.services.invocations import _ANSWER as SYNC_ANSWER

router = APIRouter(prefix="/v1/invocations", tags=["invocations"])

InvocationId = Annotated[str, Path(pattern=ID_PATTERN)]


def invocation_out(i: Invocation, callback: CallbackDelivery | None = None) -> InvocationOut:
    return InvocationOut(
        id=i.id,
        function=i.function,
        version=i.version,
        mode=InvocationMode(i.mode or InvocationMode.SYNC),
        status=InvocationStatus(i.status),
        created_at=i.created_at,
        started_at=i.started_at,
        ended_at=i.ended_at,
        duration_ms=i.duration_ms,
        exit_code=i.exit_code,
        error=i.error,
        stderr_tail=i.stderr_tail,
        attempt=i.attempt,
        max_attempts=i.max_attempts,
        node=i.claimed_by,
        lost_attempts=[LostAttemptOut.model_validate(a) for a in i.lost_attempts or ()],
        callback=callback_out(callback) if callback is not None else None,
    )


def callback_out(d: CallbackDelivery) -> CallbackOut:
    return CallbackOut(
        url=d.url, status=CallbackStatus(d.status), attempts=d.attempts, last_status_code=d.last_status_code, last_error=d.last_error,
        delivered_at=d.delivered_at,
    )


def callback_body(i: Invocation, callback: CallbackDelivery) -> bytes:
    """What a callback POSTs: the final record, as GET /v1/invocations/{id} shows it."""
    return invocation_out(i, callback).model_dump_json().encode()


async def with_callbacks(session: AsyncSession, tenant_id: str, rows: Sequence[Invocation]) -> list[InvocationOut]:
    found = await CallbackRepository(session).of(tenant_id, [i.id for i in rows if i.mode == InvocationMode.ASYNC.value])
    return [invocation_out(i, found.get(i.id)) for i in rows]


def _encode_cursor(i: Invocation) -> str:
    raw = json.dumps([i.created_at.isoformat(), i.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        t, i = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        when = datetime.fromisoformat(t)
        if not isinstance(i, str):
            raise ValueError
    except (ValueError, TypeError, binascii.Error, json.JSONDecodeError):
        raise ApiError(400, "invalid_cursor", "the cursor is not one this API returned; start again without it") from None
    return when, i


_NOT_FOUND = "no such invocation (or another tenant's)"


@router.get("/{invocation_id}", operation_id="get_invocation", response_model=InvocationOut, responses=error_responses(401, 403, 404, 422, s404=_NOT_FOUND))
async def get_invocation(invocation_id: InvocationId, tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> InvocationOut:
    repo = InvocationRepository(session, tenant.id)
    inv = await repo.get(invocation_id, data=False)
    if inv is None:
        await platform.flush_records()  # synchronous records are batched; make this one visible
        inv = await repo.get(invocation_id, data=False)
    if inv is None:
        raise not_found("invocation")
    return (await with_callbacks(session, tenant.id, [inv]))[0]


@router.get(
    "",
    operation_id="list_invocations",
    response_model=InvocationPage,
    responses=error_responses(400, 401, 403, 422, s400="a cursor this API did not return (invalid_cursor)"),
)
async def list_invocations(
    tenant: TenantDep,
    session: SessionDep,
    platform: PlatformDep,
    function: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
    status: InvocationStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=200, description="`next_cursor` of the previous page")] = None,
) -> InvocationPage:
    """Newest first."""
    after = _decode_cursor(cursor) if cursor else None
    await platform.flush_records()
    rows = await InvocationRepository(session, tenant.id).list(function, limit + 1, status.value if status else None, after, data=False)
    items = rows[:limit]
    return InvocationPage(
        items=await with_callbacks(session, tenant.id, items),
        next_cursor=_encode_cursor(items[-1]) if len(rows) > limit else None,
    )


# How an async invocation that did not succeed answers on its output route: what a synchronous call
# that ended so answers (500 guest_error with exit_code and stderr_tail, 504 timeout, ...), and
# for the endings only the queue has, the closest status.
_FAILED: dict[InvocationStatus, tuple[int, str]] = {
    **SYNC_ANSWER,
    InvocationStatus.CANCELLED: (409, "cancelled"),
    InvocationStatus.CLIENT_CLOSED: (409, "client_closed"),
    InvocationStatus.INTERRUPTED: (500, "interrupted"),
    InvocationStatus.NOT_FOUND: (404, "not_found"),
}
_FAILED_MESSAGE = {
    InvocationStatus.CANCELLED: "the invocation was cancelled",
    InvocationStatus.INTERRUPTED: "its node stopped while it ran; it was not run again",
    InvocationStatus.NOT_FOUND: "the function was deleted before this queued invocation ran",
}


def failed_answer(inv: Invocation) -> JSONResponse:
    """The error envelope of an ended invocation that did not succeed, as a synchronous call
    that ended so would answer; `X-Invocation-Status` and `X-Invocation-Id` as on a 200."""
    status = InvocationStatus(inv.status)
    http, code = _FAILED.get(status, (500, "internal"))
    err: dict[str, object] = {"code": code, "message": inv.error or _FAILED_MESSAGE.get(status, status.value)}
    if inv.exit_code is not None:
        err["exit_code"] = inv.exit_code
    if inv.stderr_tail:
        err["stderr_tail"] = inv.stderr_tail[-4096:]
    return JSONResponse(status_code=http, content={"error": err}, headers={"X-Invocation-Status": inv.status, "X-Invocation-Id": inv.id})


@router.get(
    "/{invocation_id}/output",
    operation_id="get_invocation_output",
    response_class=Response,
    responses={
        200: {"description": "the stored stdout of a succeeded invocation (with `any=true`, of any ended one), in the function's "
                             "content type; `X-Invocation-Status` says how it ended",
              "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}},
        **error_responses(
            401, 403, 404, 409, 410, 422, 500, 504,
            s404="no such invocation, or it was not async (synchronous calls store no output); or `not_found`: its function "
                 "was deleted before it ran (`X-Invocation-Status: not_found`)",
            s409="not_finished: it is queued or running; or `cancelled` (`X-Invocation-Status: cancelled`)",
            s410="expired: the output was deleted after the retention",
            s500="it ended as a synchronous call answers 500: guest_error (with exit_code and stderr_tail), output_limit_exceeded, "
                 "device_error, worker_crashed, internal; or interrupted (its node stopped while it ran). "
                 "`X-Invocation-Status` says how it ended",
            s504="timeout: it ran past its time limit (`X-Invocation-Status: timeout`)",
        ),
    },
)
async def get_invocation_output(
    invocation_id: InvocationId,
    tenant: TenantDep,
    platform: PlatformDep,
    any_status: Annotated[bool, Query(alias="any", description="the stored stdout (200) whatever the invocation ended as, not only "
                                                               "when it succeeded; `X-Invocation-Status` says how it ended")] = False,
) -> Response:
    """200 with the stored stdout once the invocation succeeded. One that ended otherwise answers
    what a synchronous call that ended so answers (the error envelope, with exit_code and
    stderr_tail where known), unless `any=true` asks for whatever stdout it stored."""
    inv = await platform.queue.output(tenant, invocation_id, any_status=any_status)
    if inv.status != InvocationStatus.SUCCEEDED.value and not any_status:
        return failed_answer(inv)
    media_type, headers = safe_media_type(inv.content_type or ""), {"X-Invocation-Status": inv.status, "X-Invocation-Id": inv.id}
    size = inv.output_bytes or 0
    if size <= OUTPUT_SLICE:  # one slice at most: answered as one body
        return Response(b"".join([p async for p in platform.queue.output_slices(inv)]), media_type=media_type, headers=headers)
    # read from the database as it is sent: a front never holds the output whole
    return StoredOutputResponse(platform.queue.output_slices(inv), size, media_type, headers)


@router.post(
    "/{invocation_id}/cancel",
    operation_id="cancel_invocation",
    response_model=InvocationOut,
    responses=error_responses(401, 403, 404, 409, 422, s404=_NOT_FOUND, s409="already_finished: it ended before the cancel"),
)
async def cancel_invocation(invocation_id: InvocationId, tenant: TenantDep, platform: PlatformDep) -> InvocationOut:
    """A queued invocation is cancelled and never runs; a running one is stopped (its worker is
    replaced) and the reply comes once it ended."""
    return invocation_out(await platform.queue.cancel(tenant, invocation_id, lambda i: platform.stop_async(tenant.id, i)))
