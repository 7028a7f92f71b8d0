"""A front process: uvicorn serving the app on the node's inherited listening socket
(`python -m app.node.front`, started by app/node/supervisor.py). A warm call is admitted in the
node's shared table and sent straight to a worker (app/node/routes.py); the supervisor is asked
only for what it decides, such as a worker for a tenant that has none.

PROMETHEUS_MULTIPROC_DIR is in this process's environment from its start, so prometheus_client
counts into the node's shared directory from its first import.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C reaches the whole process group; the supervisor handles it and stops the fronts
    # (SIGTERM). Ignored from the first line: a front still importing would die with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ap = argparse.ArgumentParser()
    ap.add_argument("--fd", type=int, required=True, help="the node's listening socket")
    ap.add_argument("--ipc", required=True, help="the supervisor's unix socket")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)

    from app.worker.lifeline import die_with_parent

    die_with_parent(args.parent_pid)  # a front never outlives its supervisor

    import uvicorn

    from app.api.edge import server_options
    from app.main import create_app
    from app.node.accept import SharedPortServer
    from app.node.spin import AWAKE
    from app.observability.logging import configure_logging
    from app.settings import get_settings

    settings = get_settings()
    configure_logging(settings)
    AWAKE.spin.seconds = settings.spin_us / 1e6
    sock = socket.socket(fileno=args.fd)  # the family (IPv4/IPv6) comes from the socket itself
    app = create_app(settings, node_socket=args.ipc, front=args.index, freeze_heap=True)
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        log_config=None,
        access_log=False,
        lifespan="on",
        **server_options(settings, app.state.metrics.edge_event),  # the edge limits (app/api/edge.py)
    )
    server = SharedPortServer(config, sock)
    server.run()  # uvicorn's loop choice (uvloop with uvicorn[standard]), not asyncio.run's
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
