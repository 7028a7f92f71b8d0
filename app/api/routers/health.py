from __future__ import annotations

import hmac

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from app.api.deps import PlatformDep
from app.api.errors import ApiError
from app.api.schemas import Health

router = APIRouter(tags=["ops"])


@router.get("/healthz", operation_id="healthz", response_model=Health)
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", operation_id="readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(platform: PlatformDep) -> JSONResponse:
    detail: dict[str, object] = {}
    ok = True
    try:
        async with platform.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        detail["database"] = "ok"
    except Exception as exc:
        ok = False
        detail["database"] = f"unreachable: {type(exc).__name__}"
    workers = await platform.node.ready()
    detail["workers"] = "ok" if workers else "none ready"
    ok = ok and workers
    return JSONResponse(status_code=200 if ok else 503, content=Health(status="ok" if ok else "unavailable", detail=detail).model_dump())


@router.get(
    "/metrics",
    operation_id="metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
async def metrics(request: Request, platform: PlatformDep) -> Response:
    token = platform.settings.metrics_token
    if token:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise ApiError(401, "unauthorized", "send `Authorization: Bearer <metrics token>`", {"WWW-Authenticate": "Bearer"})
    return Response(platform.metrics.render() + await platform.node.metrics_text(), media_type=CONTENT_TYPE_LATEST)
