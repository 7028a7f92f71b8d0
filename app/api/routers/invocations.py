from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from app.api.deps import PlatformDep, SessionDep, TenantDep
from app.api.errors import error_responses, not_found
from app.api.schemas import ID_PATTERN, NAME_PATTERN, InvocationOut
from app.db.models import Invocation
from app.db.repositories.invocations import InvocationRepository

router = APIRouter(prefix="/v1/invocations", tags=["invocations"])


def invocation_out(i: Invocation) -> InvocationOut:
    return InvocationOut(
        id=i.id,
        function=i.function,
        version=i.version,
        status=i.status,
        started_at=i.started_at,
        duration_ms=i.duration_ms,
        exit_code=i.exit_code,
        error=i.error,
        stderr_tail=i.stderr_tail,
    )


@router.get("/{invocation_id}", operation_id="get_invocation", response_model=InvocationOut, responses=error_responses(401, 403, 404, 422))
async def get_invocation(invocation_id: Annotated[str, Path(pattern=ID_PATTERN)], tenant: TenantDep, session: SessionDep, platform: PlatformDep) -> InvocationOut:
    await platform.recorder.flush()  # records are batched; make this one visible
    inv = await InvocationRepository(session, tenant.id).get(invocation_id)
    if inv is None:
        raise not_found("invocation")
    return invocation_out(inv)


@router.get("", operation_id="list_invocations", response_model=list[InvocationOut], responses=error_responses(401, 403, 422))
async def list_invocations(
    tenant: TenantDep,
    session: SessionDep,
    platform: PlatformDep,
    function: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[InvocationOut]:
    await platform.recorder.flush()
    return [invocation_out(i) for i in await InvocationRepository(session, tenant.id).list(function, limit)]
