"""`tensorwasm serve`: the whole node in this process (`TENSORWASM_PROCESSES=1`), or a
supervisor with N fronts (app/node/supervisor.py)."""

from __future__ import annotations

from app.node.startup import announce_admin_token
from app.settings import Settings


def serve(settings: Settings, host: str, port: int) -> int:
    token, generated = settings.ensure_admin_token()
    if generated:  # once, here: the fronts read the saved token
        announce_admin_token(settings, token)
    if settings.processes > 1:
        from app.node.supervisor import run_supervisor

        return run_supervisor(settings, host, port)

    import uvicorn

    from app.main import create_app

    config = uvicorn.Config(
        create_app(settings, freeze_heap=True),
        host=host,
        port=port,
        log_level=settings.log_level,
        log_config=None,  # keep our handler: uvicorn's lines become structured too
        access_log=False,  # the app's middleware writes access lines (TENSORWASM_ACCESS_LOG)
    )
    uvicorn.Server(config).run()
    return 0
