from __future__ import annotations

import hmac

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from app.api.deps import PlatformDep
from app.api.errors import ApiError, error_responses
from app.api.schemas import DeviceOut, Health, Ready

router = APIRouter(tags=["ops"])


@router.get("/healthz", operation_id="healthz", response_model=Health)
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    operation_id="readyz",
    response_model=Ready,
    responses={503: {"model": Ready, "description": "the database or the workers are not ready"}},
)
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
    readiness = await platform.node.readiness()  # a worker ready, and some device not backing off
    workers = readiness.workers
    detail["workers"] = "ok" if workers else "none ready"
    detail["devices"] = "ok" if readiness.devices_usable else "every device is backing off after failed starts"
    ok = ok and workers
    devices = [DeviceOut.model_validate(msgspec.structs.asdict(d)) for d in readiness.devices]
    body = Ready(status="ok" if ok else "unavailable", detail=detail, devices=devices)
    return JSONResponse(status_code=200 if ok else 503, content=body.model_dump())


@router.get(
    "/metrics",
    operation_id="metrics",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"},
        **error_responses(401, s401="TENSORWASM_METRICS_TOKEN is set and the request does not carry it"),
    },
)
async def metrics(request: Request, platform: PlatformDep) -> Response:
    token = platform.settings.metrics_token
    if token:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise ApiError(401, "unauthorized", "send `Authorization: Bearer <metrics token>`", {"WWW-Authenticate": "Bearer"})
    return Response(platform.metrics.render() + await platform.node.metrics_text(), media_type=CONTENT_TYPE_LATEST)
