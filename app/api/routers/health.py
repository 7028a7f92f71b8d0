from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app.api.deps import PlatformDep
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
    workers = platform.scheduler.ready()
    detail["workers"] = "ok" if workers else "none ready"
    ok = ok and workers
    return JSONResponse(status_code=200 if ok else 503, content=Health(status="ok" if ok else "unavailable", detail=detail).model_dump())
