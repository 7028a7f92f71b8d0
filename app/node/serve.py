"""`tensorwasm serve`: the whole node in this process (`TENSORWASM_PROCESSES=1`), or a
supervisor with N fronts (app/node/supervisor.py)."""

from __future__ import annotations

import errno
import os
import socket

from app.node.startup import announce_admin_token
from app.settings import Settings


class CannotListen(Exception):
    """The node's address cannot be listened on; the message names it and what to do."""


def listen_error(host: str, port: int, exc: OSError) -> CannotListen:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        why, fix = "the address is already in use (another server listens there)", "port"
    elif exc.errno == errno.EACCES:
        why, fix = "this user may not listen there (ports below 1024 need privileges)", "port"
    else:
        why, fix = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc)).split(" (while attempting")[0], "host"
    flag = f"--{fix} or TENSORWASM_{fix.upper()}"
    return CannotListen(f"cannot listen on {where}: {why}; choose another {fix} with {flag}")


def listener(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening TCP socket on (host, port), or CannotListen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as exc:
        raise listen_error(host, port, exc) from None


def serve(settings: Settings, host: str, port: int) -> int:
    """Serve until stopped; CannotListen, before anything starts, where the address is taken."""
    listener(host, port).close()  # the address is free (uvicorn, or the supervisor, binds it next)
    token, generated = settings.ensure_admin_token()
    if generated:  # once, here: the fronts read the saved token
        announce_admin_token(settings, token)
    if settings.processes > 1:
        from app.node.supervisor import run_supervisor

        return run_supervisor(settings, host, port)

    import uvicorn

    from app.api.edge import server_options
    from app.main import create_app

    app = create_app(settings, freeze_heap=True)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=settings.log_level,
        log_config=None,  # keep our handler: uvicorn's lines become structured too
        access_log=False,  # the app's middleware writes access lines (TENSORWASM_ACCESS_LOG)
        **server_options(settings, app.state.metrics.edge_event),  # the edge limits (app/api/edge.py)
    )
    uvicorn.Server(config).run()
    return 0
