"""`tensorwasm serve`: the whole node in this process (`TENSORWASM_PROCESSES=1`), or a
supervisor with N fronts (app/node/supervisor.py)."""

from __future__ import annotations

import sys

from app.settings import Settings


def serve(settings: Settings, host: str, port: int) -> int:
    token, generated = settings.ensure_admin_token()
    if generated:
        print(f"TensorWasm generated an admin token (saved in {settings.data_dir / 'admin_token'}):\n  {token}", file=sys.stderr, flush=True)
    if settings.processes > 1:
        from app.node.supervisor import run_supervisor

        return run_supervisor(settings, host, port)

    import uvicorn

    from app.main import create_app

    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        log_level=settings.log_level,
        log_config=None,  # keep our handler: uvicorn's lines become structured too
        access_log=False,  # the app's middleware writes access lines (TENSORWASM_ACCESS_LOG)
    )
    return 0
