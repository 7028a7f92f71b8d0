from __future__ import annotations

import contextlib

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from app.api.deps import PlatformDep, admit_metrics
from app.api.errors import error_responses
from app.api.schemas import ClusterOut, DeviceOut, Health, Ready
from app.services.nodes import cluster_view

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
    cluster: ClusterOut | None = None
    try:
        async with platform.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        detail["database"] = "ok"
    except Exception as exc:
        ok = False
        detail["database"] = f"unreachable: {type(exc).__name__}"
    if ok:
        # reported, not required: a stale heartbeat moves this node's async work elsewhere, yet
        # it still serves its tenants' calls, which a 503 here would send to other nodes too
        with contextlib.suppress(Exception):
            async with platform.sessionmaker() as session:
                view = await cluster_view(session, platform.settings, platform.clock())
            cluster = ClusterOut.model_validate(view, from_attributes=True)
    readiness = await platform.node.readiness()  # a worker ready, and some device not backing off
    workers = readiness.workers or readiness.on_demand
    if readiness.workers:
        detail["workers"] = "ok"
    else:
        detail["workers"] = "none kept: the first call starts one (TENSORWASM_WARM_SPARES=0)" if readiness.on_demand else "none ready"
    detail["devices"] = "ok" if readiness.devices_usable else "every device is backing off after failed starts"
    ok = ok and workers
    devices = [DeviceOut.model_validate(msgspec.structs.asdict(d)) for d in readiness.devices]
    body = Ready(status="ok" if ok else "unavailable", detail=detail, devices=devices, cluster=cluster)
    return JSONResponse(status_code=200 if ok else 503, content=body.model_dump(mode="json"))


@router.get(
    "/metrics",
    operation_id="metrics",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"},
        **error_responses(
            401, 429,
            s401="no metrics token (TENSORWASM_METRICS_TOKEN) where one is set; without one, a caller off loopback without the admin token",
            s429="too many failed authentications from this address",
        ),
    },
)
async def metrics(request: Request, platform: PlatformDep) -> Response:
    await admit_metrics(platform, request.headers.get("authorization", "").encode("latin-1"), request.client.host if request.client else None)
    return Response(platform.metrics.render() + await platform.node.metrics_text(), media_type=CONTENT_TYPE_LATEST)
