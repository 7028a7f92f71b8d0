from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.errors import ApiError, error_responses, not_found
from app.api.media import safe_media_type
from app.api.schemas import ID_PATTERN, NAME_PATTERN, InvocationOut, InvocationPage
from app.db.models import Invocation
from app.db.repositories.invocations import InvocationRepository
from app.queue.states import InvocationMode, InvocationStatus

router = APIRouter(prefix="/v1/invocations", tags=["invocations"])

InvocationId = Annotated[str, Path(pattern=ID_PATTERN)]


def invocation_out(i: Invocation) -> InvocationOut:
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
    )


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
    inv = await repo.get(invocation_id)
    if inv is None:
        await platform.flush_records()  # synchronous records are batched; make this one visible
        inv = await repo.get(invocation_id)
    if inv is None:
        raise not_found("invocation")
    return invocation_out(inv)


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
    rows = await InvocationRepository(session, tenant.id).list(function, limit + 1, status.value if status else None, after)
    items = rows[:limit]
    return InvocationPage(
        items=[invocation_out(i) for i in items],
        next_cursor=_encode_cursor(items[-1]) if len(rows) > limit else None,
    )


@router.get(
    "/{invocation_id}/output",
    operation_id="get_invocation_output",
    response_class=Response,
    responses={
        200: {"description": "the stored stdout, in the function's content type; `X-Invocation-Status` says how it ended",
              "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}},
        **error_responses(
            401, 403, 404, 409, 410, 422,
            s404="no such invocation, or it was not async (synchronous calls store no output)",
            s409="not_finished: it is queued or running",
            s410="expired: the output was deleted after the retention",
        ),
    },
)
async def get_invocation_output(invocation_id: InvocationId, tenant: TenantDep, platform: PlatformDep) -> Response:
    inv = await platform.queue.output(tenant, invocation_id)
    return Response(
        content=inv.output or b"",
        media_type=safe_media_type(inv.content_type or ""),
        headers={"X-Invocation-Status": inv.status, "X-Invocation-Id": inv.id},
    )


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
