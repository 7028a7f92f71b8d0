"""uvicorn on the node's shared listening socket, taking one connection per event-loop turn.

Every front waits on the one socket the supervisor bound. uvicorn's own server (libuv under
uvloop) accepts every pending connection each time the socket turns readable, so whichever front
woke first took a burst whole: wrk's 32 connections landed 17/6/4/3/1/1 on 8 fronts of the dev
VM, and on the 16-core GPU hosts the busiest front ran at ~1.6x the mean load and capped the
node. Here a front takes one connection at a time and then, the more connections it already
serves, the longer it leaves the socket to the other fronts.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)

_RETRY_S = 0.1  # after an accept error (out of file descriptors): let the other fronts take them
_YIELD_S = 0.0002  # per connection served: how long a front leaves new ones to the others
_HELD_CAP = 5
# Past this many connections waiting in the socket's queue, a front takes up to _BATCH at once
# and yields nothing: a flood of connections (most of them idle or slow) would otherwise fill the
# queue while the fronts paused, and a real client's connection would wait behind it for seconds.
# Above the largest burst of real clients the benches open at once (wrk's 256 connections), so
# those still spread over the fronts.
_DEEP = 512
_BATCH = 64
_TCPI_UNACKED = 24  # offset of tcpi_unacked in struct tcp_info: a listener's queue length (Linux)


def _queued(listener: socket.socket) -> int:
    """Connections waiting in `listener`'s accept queue; 0 where the kernel does not say."""
    try:
        info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_UNACKED + 4)
    except (OSError, AttributeError):
        return 0
    return int.from_bytes(info[_TCPI_UNACKED : _TCPI_UNACKED + 4], sys.byteorder) if len(info) >= _TCPI_UNACKED + 4 else 0


class SharedPortServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, listener: socket.socket) -> None:
        super().__init__(config)
        self.listener = listener
        self._reading = False
        self._tasks: set[asyncio.Task[object]] = set()
        self._tcp = listener.family in (socket.AF_INET, socket.AF_INET6)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGINT:  # a front's Ctrl-C is its supervisor's (app/node/front.py)
            super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the app's lifespan and uvicorn's state, no server of its own
        if not self.started:
            return
        self.listener.setblocking(False)
        self._resume()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._pause()
        await super().shutdown(sockets)

    def _protocol(self) -> asyncio.Protocol:
        config = self.config
        return config.http_protocol_class(config=config, server_state=self.server_state, app_state=self.lifespan.state)  # type: ignore[call-arg]

    def _resume(self) -> None:
        if not self._reading and not self.should_exit:
            asyncio.get_running_loop().add_reader(self.listener.fileno(), self._accept)
            self._reading = True

    def _pause(self) -> None:
        if self._reading:
            asyncio.get_running_loop().remove_reader(self.listener.fileno())
            self._reading = False

    def _accept(self) -> None:
        if not self._take():
            return
        if self._tcp and _queued(self.listener) > _DEEP:
            for _ in range(_BATCH - 1):
                if not self._take():
                    return
            return
        loop = asyncio.get_running_loop()
        # The more connections this front serves, the longer it leaves the socket to the others:
        # at a burst the fronts with fewer take the next ones. Bounded: 8 fronts that each serve 5
        # or more still accept 8 / 1 ms = 8,000 new connections a second between them.
        held = min(len(self.server_state.connections) + len(self._tasks), _HELD_CAP)
        if held > 1:
            self._pause()
            loop.call_later(held * _YIELD_S, self._resume)

    def _take(self) -> bool:
        """Accept one connection and set it up; False when there was none to take."""
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return False  # another front took it
        except OSError as exc:
            if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                return False  # the client left before it was accepted
            log.error("accepting a connection failed: %s", exc)
            self._pause()  # the socket stays readable: do not spin on it
            asyncio.get_running_loop().call_later(_RETRY_S, self._resume)
            return False
        if self._tcp:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = asyncio.get_running_loop().create_task(self._connect(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(self._protocol, conn)
        except OSError:
            conn.close()  # reset before the transport took it
