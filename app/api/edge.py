"""The front's HTTP/1.1 connections under limits: uvicorn's httptools protocol with a bound on
open connections, on the time and size of a request's head, and on how slowly a body may come.

Without these a client needs no credentials to hold a front: connections that never finish
their head stay open until the front runs out of descriptors, one endless header is buffered
(and re-joined, quadratically) inside the parser, and a body trickled a byte at a time holds a
request forever. Each limit here costs a counter per connection (a slow body, a timer).

- **Connections**: past `max_connections` on this front, the connection that has waited longest
  for a request head (an idle keep-alive or a slow head) is closed to make room; only when every
  connection is in a request does the new one get 503 and close.
- **Head**: a request's head (request line and headers) must arrive in full within
  `head_timeout_s` of the connection opening or of the previous response (408 and close), and
  hold at most `max_head_bytes` bytes and `max_headers` fields (431 and close). The byte bound is
  checked per read, so at most one read (≤ 256 KiB) passes it before the refusal.
- **Body**: after `body_grace_s`, a body still arriving must have averaged `min_body_rate` bytes a
  second over the time the front was reading it (time paused by the front's own flow control
  does not count); else 408 and close.
- A response sent before its request's body arrived in full closes the connection: the rest of
  that body is never read.

The head's time and the keep-alive's are judged by one sweep per server (`_Sweep`), not by a
timer per request: a connection waiting for a head only stamps when it began to wait. The two
timers a request armed and cancelled (this module's and uvicorn's keep-alive) cost a front
~2.5 µs a call on the 2-core dev VM, on the path between an answer and the next request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, cast

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.settings import Settings

log = logging.getLogger(__name__)

_TICK_S = 1.0  # how often a body's rate is checked
# The sweep's period: a tenth of the shorter of the head and keep-alive times (a connection is
# closed at most that much late), within these bounds
_SWEEP_MIN_S, _SWEEP_MAX_S = 0.01, 0.5


# A request's scope key: on requests this edge serves, a function that takes a callable and
# calls it, once, when the client goes away before the answer is complete.
ON_CLIENT_GONE = "tensorwasm.on_client_gone"
# Another: a function (status, headers, body) that writes a whole answer at once, its
# Content-Length added, and returns True; False when it wrote nothing (the answer goes through
# ASGI `send` as usual). Header names must be lowercase and values plain (no control
# characters): uvicorn's `send` checks each one with two regular expressions and writes the
# head apart from the body, which cost a front ~10 % of its CPU per call on the dev VM.
RESPOND_NOW = "tensorwasm.respond_now"


class EdgeEvent(StrEnum):
    """Why the edge refused or closed a connection (the metric's `reason`)."""

    CONNECTIONS_FULL = "connections_full"  # 503: every connection was inside a request
    MADE_ROOM = "made_room"  # the longest waiting for a head, closed for a new one
    HEAD_TIMEOUT = "head_timeout"  # 408
    HEAD_TOO_LARGE = "head_too_large"  # 431
    BODY_TOO_SLOW = "body_too_slow"  # 408


@dataclass(frozen=True)
class EdgeLimits:
    max_connections: int
    head_timeout_s: float
    max_head_bytes: int
    max_headers: int
    body_grace_s: float
    min_body_rate: int  # bytes a second; 0: no rate

    @classmethod
    def of(cls, settings: Settings, max_connections: int | None = None) -> EdgeLimits:
        return cls(
            max_connections=max_connections if max_connections is not None else settings.max_connections,
            head_timeout_s=settings.head_timeout_s,
            max_head_bytes=settings.max_head_bytes,
            max_headers=settings.max_headers,
            body_grace_s=settings.body_grace_s,
            min_body_rate=settings.min_body_bytes_per_s,
        )


def _response(status: int, reason: str, code: str, message: str, retry_after: int | None = None) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class EdgeProtocol(HttpToolsProtocol):
    """One connection. Subclassed per server by `edge_protocol`, which binds the limits and the
    server's set of connections waiting for a head (oldest first, the ones closed to make room)."""

    limits: ClassVar[EdgeLimits]
    waiting: ClassVar[OrderedDict[EdgeProtocol, None]]
    listeners: ClassVar[tuple[Callable[[EdgeEvent], None], ...]] = ()
    sweep: ClassVar[_Sweep | None] = None  # the server's, made at its first connection

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_fields = 0
        self._waiting_since = 0.0  # the loop's time when this connection began to wait for a head
        # ... after an answer with no byte since (an idle keep-alive), not at its opening
        self._answered = False
        self._body_timer: asyncio.TimerHandle | None = None
        self._in_body = False  # between a head and the end of its body
        self._body_bytes = 0
        self._body_open_s = 0.0
        self._gone: tuple[Any, Callable[[], None]] | None = None  # the request told when its client goes

    def _tell(self, event: EdgeEvent) -> None:
        for listener in self.listeners:
            listener(event)

    # -- connections --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            self._tell(EdgeEvent.CONNECTIONS_FULL)
            self._refuse(
                _response(503, "Service Unavailable", "too_many_connections", "this front serves as many connections as it may; try again shortly", 1)
            )
            return
        self._await_head()

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a head; False when none waits."""
        for other in self.waiting:
            if other is not self:
                other._stop_waiting()
                other.transport.close()
                self._tell(EdgeEvent.MADE_ROOM)
                return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        self._stop_body()
        self._client_gone()
        super().connection_lost(exc)

    def _tell_when_gone(self, cycle: Any, callback: Callable[[], None] | None) -> None:
        """`ON_CLIENT_GONE` of the request `cycle` serves: no task of its own has to wait on
        `receive` for the disconnect. None: the request no longer asks."""
        self._gone = (cycle, callback) if callback is not None and cycle is not None else None
        if self._gone is None:
            return
        if cycle.disconnected:  # gone already (while its body was read)
            self._client_gone()
        else:
            # as `receive` would: a body over the transport's high-water mark paused reading,
            # and only reading sees the client close
            self.flow.resume_reading()

    def _respond_now(self, cycle: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes | bytearray | memoryview) -> bool:
        """`RESPOND_NOW` of the request `cycle` serves: what uvicorn's `send` does for a whole
        answer with a length, in one write. Not for HEAD (no body), an answer already started, a
        gone client, a transport whose buffer is full (`send` waits for it), or uvicorn's own
        access log."""
        if (
            cycle is None or cycle.response_started or cycle.disconnected or cycle.flow.write_paused
            or cycle.access_log or cycle.scope["method"] == "HEAD" or status not in STATUS_LINE
        ):
            return False
        parts: list[bytes | bytearray | memoryview] = [STATUS_LINE[status]]
        for name, value in cycle.default_headers:  # the server's (date, server)
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"content-length: %d\r\n" % len(body),)
        keep_alive = cycle.keep_alive
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", body)
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        self.transport.write(b"".join(parts))
        cycle.response_complete = True
        cycle.message_event.set()
        if not keep_alive:
            self.transport.close()
        cycle.on_response()
        return True

    def _client_gone(self) -> None:
        """Tell the request in progress, if it asked: once, and only while its answer is not complete."""
        gone, self._gone = self._gone, None
        if gone is not None and gone[0] is self.cycle and not gone[0].response_complete:
            gone[1]()

    def _refuse(self, response: bytes) -> None:
        self._stop_waiting()
        self._stop_body()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's request sees the client gone, and writes nothing
            cycle.message_event.set()
            self._client_gone()
            if cycle.response_started:
                response = b""
        if not self.transport.is_closing():
            if response:
                self.transport.write(response)
            self.transport.close()

    # -- the head -----------------------------------------------------------------------------
    def _await_head(self, answered: bool = False) -> None:
        self._in_head = True
        self._head_bytes = self._head_fields = 0
        self._waiting_since, self._answered = self.loop.time(), answered
        waiting = self.waiting
        waiting[self] = None
        waiting.move_to_end(self)  # so the sweep meets the connections in the order they began to wait
        sweep = type(self).sweep
        if sweep is None or sweep.loop is not self.loop:  # the server's first connection (on this loop)
            sweep = type(self).sweep = _Sweep(self.loop, self.limits, self.timeout_keep_alive, waiting)
        sweep.wake()

    def _stop_waiting(self) -> None:
        self.waiting.pop(self, None)

    def _head_expired(self) -> None:
        self._tell(EdgeEvent.HEAD_TIMEOUT)
        limit = self.limits.head_timeout_s
        self._refuse(_response(408, "Request Timeout", "request_timeout", f"the request's head did not arrive within {limit:g} s"))

    def _head_too_large(self, what: str) -> None:
        self._tell(EdgeEvent.HEAD_TOO_LARGE)
        self._refuse(_response(431, "Request Header Fields Too Large", "headers_too_large", what))

    def data_received(self, data: bytes) -> None:
        self._answered = False  # a byte of the next request: no idle keep-alive any more
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._in_head and self._head_bytes > self.limits.max_head_bytes:
            self._head_too_large(f"the request's head is larger than {self.limits.max_head_bytes} bytes")
        elif self._in_body and self._body_timer is None:  # a body still to come: time its rate
            self._body_timer = self.loop.call_later(_TICK_S, self._body_tick)

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_bytes = 0  # the read that held this head's start also held the last body's end
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += 1
        if self._head_fields > self.limits.max_headers:
            if not self.transport.is_closing():
                self._head_too_large(f"the request has more than {self.limits.max_headers} header fields")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.transport.is_closing():
            return  # refused while parsing this head
        self._in_head = False
        self._stop_waiting()
        super().on_headers_complete()
        if self.cycle is not None:
            # the cycle by a weak reference: one the scope held would make the request's objects a
            # reference cycle (scope, callable, cycle), each left to the collector (~13 µs a call)
            cycle = weakref.ref(self.cycle)
            scope = cast(dict[str, Any], self.cycle.scope)
            scope[ON_CLIENT_GONE] = lambda callback: self._tell_when_gone(cycle(), callback)
            scope[RESPOND_NOW] = lambda status, headers, body: self._respond_now(cycle(), status, headers, body)
            if self.cycle.scope["method"] != "HEAD":  # a HEAD answer has no body write to join
                self.cycle.transport = _HeadWithBody(self.transport)  # type: ignore[assignment]
        if self.limits.min_body_rate and not self.parser.should_upgrade():
            # timed from the end of this read, and only if the body has not all come with it
            self._in_body, self._body_bytes, self._body_open_s = True, 0, 0.0

    # -- the body -----------------------------------------------------------------------------
    def on_body(self, body: bytes) -> None:
        if self.transport.is_closing():
            return  # refused while parsing: the rest of this read is dropped
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._stop_body()
        if not self.transport.is_closing():
            super().on_message_complete()

    def _stop_body(self) -> None:
        self._in_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_tick(self) -> None:
        self._body_timer = None
        if not self.flow.read_paused:  # paused by us (the app is not reading): not the client's time
            self._body_open_s += _TICK_S
        late = self._body_open_s - self.limits.body_grace_s
        if late > 0 and self._body_bytes < self.limits.min_body_rate * late:
            rate = self.limits.min_body_rate
            self._tell(EdgeEvent.BODY_TOO_SLOW)
            self._refuse(_response(408, "Request Timeout", "request_timeout", f"the request's body arrived slower than {rate} bytes a second"))
            return
        self._body_timer = self.loop.call_later(_TICK_S, self._body_tick)

    # -- between requests ---------------------------------------------------------------------
    def on_response_complete(self) -> None:
        # the cycle that ended is `self.cycle` unless a pipelined request was parsed after it
        # (then its own body had ended, and `self.cycle` is the waiting one's)
        cycle = self.cycle if not self.pipeline else None
        if cycle is not None and cycle.more_body and not self.transport.is_closing():
            self._stop_body()
            self.transport.close()  # answered before its body arrived: the rest is never read
            return
        if self.pipeline or self.transport.is_closing():
            super().on_response_complete()  # the next request started (or none): no keep-alive timer
            return
        # uvicorn's own steps for an answer with no request behind it, less its keep-alive
        # timer: the sweep closes an idle keep-alive connection at that time instead
        self.server_state.total_requests += 1
        self.flow.resume_reading()
        self._await_head(answered=True)


class _Sweep:
    """One server's connections waiting for a head, looked at every `period` seconds while there
    are any: one waiting longer than the head's time is refused (408, as a request that took too
    long), and an idle keep-alive (no byte of a next request since its answer) longer than the
    keep-alive time is closed quietly, as uvicorn's own timer closes it. The set is in the order
    the connections began to wait, so a look stops at the first that may wait on."""

    __slots__ = ("loop", "_limits", "_keep_alive_s", "_waiting", "_handle", "period")

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: EdgeLimits, keep_alive_s: float, waiting: OrderedDict[EdgeProtocol, None]) -> None:
        self.loop, self._limits, self._keep_alive_s, self._waiting = loop, limits, keep_alive_s, waiting
        self._handle: asyncio.TimerHandle | None = None
        self.period = min(_SWEEP_MAX_S, max(_SWEEP_MIN_S, min(limits.head_timeout_s, keep_alive_s) / 10))

    def wake(self) -> None:
        if self._handle is None:
            self._handle = self.loop.call_later(self.period, self._look)

    def _look(self) -> None:
        self._handle = None
        now = self.loop.time()
        head_s, idle_s = self._limits.head_timeout_s, self._keep_alive_s
        first_s = min(head_s, idle_s)
        expired: list[tuple[EdgeProtocol, bool]] = []  # (connection, whether its head is late)
        for conn in self._waiting:
            waited = now - conn._waiting_since
            if waited < first_s:
                break  # every later one began to wait after this one
            if waited >= head_s:
                expired.append((conn, True))
            elif conn._answered and waited >= idle_s:
                expired.append((conn, False))
        for conn, late in expired:
            if conn.transport.is_closing():
                conn._stop_waiting()
            elif late:
                conn._head_expired()
            else:
                conn._stop_waiting()
                conn.transport.close()
        if self._waiting:
            self._handle = self.loop.call_later(self.period, self._look)


class _HeadWithBody:
    """The transport as one request's cycle sees it: a response's head that declares its length
    is held until the body's first write, and both leave in one send. uvicorn writes them apart:
    two syscalls and two segments per answer, a tenth of a front's CPU per call on the dev VM.
    A streamed answer (no length) and 1xx heads go at once; closing flushes what is held."""

    __slots__ = ("_transport", "_head")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._head:
            head, self._head = self._head, b""
            if data:
                self._transport.writelines((head, data))
            else:  # an empty part never drains from asyncio's transport (app/contract/frames.py)
                self._transport.write(head)
        elif bytes(data[:9]) == b"HTTP/1.1 " and bytes(data[9:10]) != b"1" and b"\r\ncontent-length:" in data:
            self._head = bytes(data)
        else:
            self._transport.write(data)

    def close(self) -> None:
        if self._head:
            head, self._head = self._head, b""
            self._transport.write(head)
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def edge_protocol(limits: EdgeLimits, on_event: Callable[[EdgeEvent], None] | None = None) -> type[EdgeProtocol]:
    """A protocol class for one server: its limits, its own set of waiting connections, and
    what to tell of each refusal (a metric)."""
    listeners = (on_event,) if on_event is not None else ()
    return type("BoundEdgeProtocol", (EdgeProtocol,), {"limits": limits, "waiting": OrderedDict(), "listeners": listeners})


_RESERVED_FDS = 512  # the front's own: database, workers, supervisor, compile sandboxes, logs


def raise_fd_limit() -> int:
    """Raise this process's descriptor limit to its hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def server_options(settings: Settings, on_event: Callable[[EdgeEvent], None] | None = None) -> dict[str, Any]:
    """uvicorn.Config's arguments for a serving process: the edge protocol and its keep-alive,
    with `max_connections` cut to what the descriptor limit allows."""
    fds = raise_fd_limit()
    connections = min(settings.max_connections, max(16, fds - _RESERVED_FDS))
    if connections < settings.max_connections:
        log.warning("TENSORWASM_MAX_CONNECTIONS is %d but the descriptor limit (%d) allows %d", settings.max_connections, fds, connections)
    return {"http": edge_protocol(EdgeLimits.of(settings, connections), on_event), "timeout_keep_alive": settings.keepalive_timeout_s}
