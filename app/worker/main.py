"""Worker process: one device context, one bound tenant, one guest at a time.

Started by the api process as a fresh interpreter (`python -m app.worker.main`), never forked
from it, so a CUDA context is always created in a clean process. It speaks the protocol of
app/contract/messages.py over its stdin/stdout (from the supervisor) and, in a node of
several fronts, over a unix socket where fronts send leased runs; its own prints go to stderr. It dies with the
process that started it (app/worker/lifeline.py), even in the middle of a guest.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import heapq
import hmac
import itertools
import logging
import os
import select
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from app.contract.frames import HEAD, FrameSink, ProtocolError, check_sizes, decode_header, read_frame, write_frame
from app.contract.messages import (
    Bind,
    Chunk,
    DeviceInfo,
    Done,
    Exit,
    Failed,
    HostCounts,
    Ping,
    Pong,
    Ready,
    Refused,
    RefuseReason,
    Result,
    Run,
    RunStatus,
    StartRefusal,
    WorkerMessage,
    lease_mac,
)
from app.node.spin import Spin
from app.worker.stats import run_mark

REFUSED_EXIT = 75  # the driver refused this worker's context (the `refused` frame says so too)


def _make_backend(kind: str, cache_dir: Path, memory_kind: str) -> Any:
    from app.gpu.cpu import CpuBackend

    if kind in ("cuda", "auto"):
        from app.gpu.cuda import CudaBackend, cuda_available

        if kind == "cuda" or cuda_available():
            return CudaBackend(cache_dir, memory_kind)
    return CpuBackend()


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C in a terminal reaches the whole process group; the api process shuts workers down
    # (it closes their pipe), so a worker ignores SIGINT instead of dying with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--stats", required=True)
    ap.add_argument("--tick-ms", type=int, default=5)
    ap.add_argument("--max-buffers", type=int, default=1024)
    ap.add_argument("--max-modules", type=int, default=64)
    ap.add_argument("--gpu-memory", default="managed", choices=("managed", "device"))
    ap.add_argument("--pin-budget", type=int, default=0)
    ap.add_argument("--node-pid", type=int, default=None, help="die when this process (the node) is gone")
    ap.add_argument("--socket", default=None, help="also serve fronts' runs on this unix socket")
    ap.add_argument("--spin-us", type=int, default=0, help="poll this long after a run before sleeping")
    args = ap.parse_args(argv)
    if args.node_pid is not None:
        from app.worker.lifeline import die_with_parent

        die_with_parent(args.node_pid)  # first: before the seconds spent importing the runtime

    # Keep the protocol on private descriptors; anything printed lands on stderr instead.
    proto_in = os.fdopen(os.dup(0), "rb", buffering=1 << 16)
    proto_out = os.fdopen(os.dup(1), "wb", buffering=1 << 16)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="worker %(process)d %(levelname)s %(message)s")

    from app.gpu.abi import AbiHost
    from app.gpu.cuda import ContextRefused  # no CuPy import: that module loads it when used
    from app.runtime.artifacts import ArtifactCache
    from app.runtime.engine import make_engine
    from app.runtime.memory import GuestMemory
    from app.runtime.runner import GuestRunner
    from app.worker.stats import StatsPage

    cache_dir = Path(args.cache_dir)
    stats = StatsPage(Path(args.stats), create=False)
    try:
        backend = _make_backend(args.backend, cache_dir, args.gpu_memory)
    except ContextRefused as exc:
        # told apart from a crash: the scheduler learns this device's context ceiling from it
        write_frame(proto_out, StartRefusal(error=str(exc)))
        return REFUSED_EXIT
    memory = GuestMemory(args.pin_budget)  # one reused region instead of a fresh mapping per call
    if hasattr(backend, "attach_guest_memory"):
        backend.attach_guest_memory(memory)
    host = AbiHost(backend, args.max_buffers, args.max_modules, memory)
    host.usage_hook = lambda used: stats.set("gpu_bytes_in_use", used)
    runner = GuestRunner(make_engine(memory), ArtifactCache(cache_dir), host, args.tick_ms, memory)
    runner.warm_up()
    memory.scrub()
    warm_lock = _warm_lock(cache_dir)
    info = backend.info
    write_frame(
        proto_out,
        Ready(
            pid=os.getpid(),
            backend=info.backend,
            device=DeviceInfo(
                name=info.name, compute_capability=info.compute_capability, total_memory_bytes=info.total_memory_bytes,
                pci_bus_id=info.pci_bus_id,
                # the device this worker was pinned to by its node (None: not pinned)
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            ),
        ),
    )
    worker = _Worker(runner, host, memory, stats, warm_lock)
    if args.socket is None:  # the in-process node: every message comes over the pipe
        while True:
            frame = read_frame(proto_in)
            if frame is None or not worker.control(frame[0], frame[1], proto_out):
                return 0
    return _serve_fronts(worker, proto_in, proto_out, args.socket, args.spin_us / 1e6)


def _warm_lock(cache_dir: Path) -> int | None:
    """The descriptor of this device's warm-up turns (see `_Worker.warm_lock`); None where the
    file cannot be opened (a read-only cache dir): warm-ups then take no turns."""
    device = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace("/", "_")
    try:
        return os.open(cache_dir / f"warm-up-{device}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        logging.getLogger(__name__).warning("warm-ups take no turns: %s", exc)
        return None


def _share(msg: Bind) -> Any:
    """This worker's side of the node's GPU share table, its row bound to the tenant; None (its
    launches never held) when the table cannot be opened: the share is fairness, not isolation."""
    from app.gpu.share import ContextShare, ShareTable

    try:
        table = ShareTable.attach(Path(msg.share_path))
    except (OSError, ValueError) as exc:
        logging.getLogger(__name__).warning("the GPU share table could not be opened: %s", exc)
        return None
    table.bind(msg.share_row, msg.tenant_id, msg.device, msg.gpu_weight)
    return ContextShare(table, msg.share_row)


class _Worker:
    """One bound tenant, one guest at a time; answers control messages and runs."""

    def __init__(self, runner: Any, host: Any, memory: Any, stats: Any, warm_lock: int | None = None) -> None:
        self.runner, self.host, self.memory, self.stats = runner, host, memory, stats
        # a descriptor every worker of the node on this device locks while it warms up (None: no
        # turns): the driver makes the handles one after another, so spares that all came idle
        # together would each hold a bind that found it mid-way for all of theirs, not one
        self.warm_lock = warm_lock
        self.invocations = 0
        self.tenant_id: str | None = None
        self.worker_id = ""
        self.secret = b""
        self.route_mac = b""  # the bound tenant's route token, made at its bind (the same on every run)
        # A lease admits one run: the supervisor leases a worker to one call at a time, so a
        # lease seen before (the current one or an older one) is spent.
        self.lease_id = ""
        self.past: deque[str] = deque(maxlen=64)
        self.kernels_version = ""  # of the kernel set the host holds (none at bind)
        # The backend's warm-up left off its start (`warm_idle`) is wanted: by a spare, and by a
        # worker bound to a tenant whose calls have used it (`Bind.warm`). Every other bound
        # worker leaves it to the first call that needs it: in a node switching tenants, each
        # bound worker's warm-up took driver time from the starts the switches wait for.
        self.deferred = True
        self.warmed = False
        self.deferred_reported = False  # the page says a call used it

    def do_deferred(self) -> bool:
        """The backend's deferred warm-up, once the worker has waited IDLE_WORK_AFTER_S for work
        (a worker busy before then makes cuBLAS's handle at its tenant's first gemm instead).
        False, still deferred, while another worker on this device warms up: one at a time."""
        held: int | None = None  # the lock, once taken
        if self.warm_lock is not None:
            try:
                fcntl.flock(self.warm_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = self.warm_lock
            except BlockingIOError:
                return False
            except OSError:  # no locks on this file system: warm up without taking turns
                pass
        self.deferred, self.warmed = False, True
        try:
            self.host.backend.warm_idle()
        except Exception as exc:  # the call that needs it makes it again, and fails there if it must
            logging.getLogger(__name__).warning("the backend's warm-up failed: %s", exc)
        finally:
            if held is not None:
                fcntl.flock(held, fcntl.LOCK_UN)
        return True

    def control(self, msg: WorkerMessage, body: bytes, out: BinaryIO) -> bool:
        """Handle one message from the pipe; False when the worker should exit."""
        if isinstance(msg, Run):
            if (refused := self.refusal(msg, now=time.monotonic())) is not None:
                write_frame(out, refused)
            else:
                self.run(msg, body, out)
        elif isinstance(msg, Bind):
            self.host.bind(msg.gpu_memory_bytes)
            if msg.share_path and msg.share_row >= 0:
                self.host.share = _share(msg)
            self.host.set_kernels(msg.kernels or {})
            self.deferred = msg.warm and not self.warmed
            self.bind_tokens(msg.tenant_id, msg.worker_id, msg.secret)
            self.kernels_version = ""
            self.stats.set("gpu_bytes_cap", msg.gpu_memory_bytes)
            write_frame(out, Done())
        elif isinstance(msg, Ping):
            write_frame(out, Pong(time=time.time()))
        elif isinstance(msg, Exit):
            return False
        else:
            write_frame(out, Failed(error=f"unexpected message {type(msg).__name__}"))
        return True

    def bind_tokens(self, tenant_id: str, worker_id: str, secret: bytes) -> None:
        """The tokens this worker takes from now on: its bound tenant's, made with `secret`."""
        self.tenant_id, self.worker_id, self.secret = tenant_id, worker_id, secret
        # a route's token is the same on every run of the tenant: made once, not an HMAC per run
        self.route_mac = lease_mac(secret, "", worker_id, tenant_id) if secret else b""

    def admit(self, msg: Run) -> str | None:
        """Why a front's run may not start, or None when its token holds: a lease's (one run) or
        a route's (the bound tenant's runs, sent by fronts without asking the supervisor)."""
        lease = msg.lease
        if lease is None or not self.secret or self.tenant_id is None:
            return "no lease for this worker"
        if lease.tenant_id != self.tenant_id:
            return "the lease is for another tenant"
        if not lease.lease_id:  # a route's token
            return None if hmac.compare_digest(lease.mac, self.route_mac) else "bad lease token"
        if not hmac.compare_digest(lease.mac, lease_mac(self.secret, lease.lease_id, self.worker_id, lease.tenant_id)):
            return "bad lease token"
        if lease.lease_id == self.lease_id or lease.lease_id in self.past:
            return "the lease was used"
        if self.lease_id:
            self.past.append(self.lease_id)
        self.lease_id = lease.lease_id
        return None

    def refusal(self, msg: Run, now: float | None) -> Refused | None:
        """A run that must not start as sent: naming a kernel set this worker does not hold
        without carrying it, or (given `now`, as it is about to start) queued past its start_by."""
        if now is not None and msg.start_by and now > msg.start_by:
            return Refused(error="queued past its start time", reason=RefuseReason.LATE)
        if msg.kernels is None and msg.kernels_version != self.kernels_version:
            return Refused(error="this worker holds another kernel set", reason=RefuseReason.KERNELS)
        return None

    def run(self, msg: Run, body: bytes, out: FrameSink, watch: int | None = None) -> None:
        """`watch`: the front's connection the run came on; a front whose caller went away
        half-closes it, which stops the guest (app/runtime/runner.py)."""
        mark = run_mark(msg.invocation_id)
        self.stats.set("running_since_ms", int(time.monotonic() * 1000))
        self.stats.set("running", mark)
        if msg.kernels is not None:
            self.kernels_version = msg.kernels_version
        if msg.stream:  # stdout leaves as written, on the channel the run came from
            self.runner.on_stdout = lambda data: write_frame(out, Chunk(), data)
            write_frame(out, Chunk())  # the guest is starting: the caller may begin its response
        res = self.runner.run(msg, body, watch)
        # stderr follows stdout in the frame's body, each sent from its own buffer: joined, stdout's
        # buffer was grown past the cap (a realloc that may copy it: twice the cap at once)
        write_frame(
            out,
            Result(
                status=res.status,
                stdout_len=len(res.stdout),
                exit_code=res.exit_code,
                error=res.error,
                duration_ms=res.duration_ms,
                host=msgspec.convert(res.host, HostCounts),
                spans=res.spans or None,
            ),
            res.stdout,
            res.stderr,
        )
        del res  # the output goes before the scrub and the next instance
        self.stats.set("last_done", mark)
        self.stats.set("running", 0)
        self.stats.set("last_used_ms", int(time.monotonic() * 1000))
        # after the reply, off the caller's path: close the call's store, scrub the guest's
        # memory, build the next call's instance (app/runtime/runner.py), publish counters
        self.runner.finish()
        self.memory.scrub()
        self.runner.prepare(msg)
        self.invocations += 1
        self.stats.set("invocations", self.invocations)
        self.stats.set("launches", self.host.launches_total)
        if not self.deferred_reported and self.host.backend.deferred_used:
            self.deferred_reported = True
            self.stats.set("deferred_used", 1)


# A worker with nothing to do this long does its deferred warm-up: long enough that a spare bound
# within a burst of new tenants is not found busy with it (at 50 ms, the bound-in-turn p50 doubled)
IDLE_WORK_AFTER_S = 1.0
# and tries again this much later while another worker on its device warms up (~0.1 s each)
WARM_TURN_S = 0.2


class _Reply:
    """The writing side of a front's connection, as `write_frame` uses it: a frame's parts are
    gathered and leave in one `sendmsg` at `flush` (a buffered socket file took a Python-level
    write per part and another for the flush, on every reply)."""

    __slots__ = ("_sock", "_parts", "_size")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._parts: list[Any] = []
        self._size = 0

    def write(self, data: Any) -> int:
        self._parts.append(data)
        n = len(data)
        self._size += n
        return n

    def flush(self) -> None:
        parts, total, self._parts, self._size = self._parts, self._size, [], 0
        if not parts:
            return
        sent = self._sock.sendmsg(parts)
        if sent < total:  # a send cut short (a signal): the rest, whole
            self._sock.sendall(b"".join(bytes(p) for p in parts)[sent:])


_FIRST_READ = 1 << 16  # a call's frame and its stdin up to this size come in one recv


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if not n:
            raise ProtocolError("the front closed mid-frame")
        view = view[n:]


def _read_call(sock: socket.socket) -> tuple[WorkerMessage, bytes] | None:
    """A front's frame off its (blocking) connection, which has turned readable; None at its end.
    One `recv` takes a small frame whole; a larger one's rest is read into a buffer of its size."""
    first = sock.recv(_FIRST_READ)
    if not first:
        return None
    if len(first) < HEAD.size:
        rest = bytearray(HEAD.size - len(first))
        _recv_exactly(sock, memoryview(rest))
        first += rest
    hlen, blen = HEAD.unpack_from(first)
    check_sizes(hlen, blen)
    size = HEAD.size + hlen + blen
    if len(first) > size:
        raise ProtocolError("a second frame before this one's answer")
    start = HEAD.size + hlen
    if len(first) == size:
        return decode_header(memoryview(first)[HEAD.size : start]), first[start:]
    whole = bytearray(size)
    whole[: len(first)] = first
    view = memoryview(whole)
    _recv_exactly(sock, view[len(first) :])
    return decode_header(view[HEAD.size : start]), bytes(view[start:])


def _serve_fronts(worker: _Worker, proto_in: BinaryIO, proto_out: BinaryIO, path: str, spin_s: float = 0.0) -> int:
    """Serve the control pipe and fronts' connections on a unix socket.

    Calls from every front wait here and run one at a time, in the order they were sent: each
    carries its `start_by` (its send time plus the node's queue wait, on the host's monotonic
    clock), which orders them whichever front and connection they came on (the order in which
    descriptors turn readable does not: a new connection is seen a turn late). Before each run
    the worker takes in every call that has come meanwhile. A connection carries one call at a
    time, so a readable descriptor never has a second frame waiting in its file buffer; one that
    turns readable again while its call waits is its front giving up (EOF): the call is answered
    cancelled without running. For `spin_s` after each run it polls instead of sleeping, so that
    at low load the next call is read as it lands rather than after a wake-up. The descriptors
    are watched with epoll itself, not `selectors` (a Python-level step for every event).
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(socket.SOMAXCONN)  # calls queued behind a long run each connect; accepted between runs
    poller = select.epoll()
    control_fd, listener_fd = proto_in.fileno(), listener.fileno()
    poller.register(control_fd, select.EPOLLIN)
    poller.register(listener_fd, select.EPOLLIN)
    conns: dict[int, tuple[socket.socket, _Reply]] = {}
    waiting: list[tuple[float, int, int]] = []  # (start_by, arrival, fd): a heap, earliest first
    calls: dict[int, tuple[Run, bytes]] = {}  # by fd: the call that waits on it
    arrivals = itertools.count()

    def drop(fd: int) -> None:
        calls.pop(fd, None)
        conn, _reply = conns.pop(fd)
        with contextlib.suppress(OSError):
            poller.unregister(fd)
        with contextlib.suppress(OSError):
            conn.close()

    def take(fd: int) -> None:
        conn, reply = conns[fd]
        try:
            frame = _read_call(conn)
            if frame is None:
                if fd in calls:  # given up before it ran: answered, so its front keeps the worker
                    write_frame(reply, Result(status=RunStatus.CANCELLED, stdout_len=0, error="the caller went away before the run started"))
                drop(fd)
                return
            msg, body = frame
            if not isinstance(msg, Run):
                write_frame(reply, Failed(error=f"unexpected message {type(msg).__name__}"))
            elif (refused := worker.refusal(msg, now=None)) is not None:  # before admit spends a lease
                write_frame(reply, refused)
            elif (why := worker.admit(msg)) is not None:
                write_frame(reply, Refused(error=why))
            else:
                calls[fd] = (msg, body)
                heapq.heappush(waiting, (msg.start_by or time.monotonic(), next(arrivals), fd))
        except (ProtocolError, OSError):  # the front went away mid-frame
            drop(fd)

    idle_for = IDLE_WORK_AFTER_S
    spin = Spin(spin_s)
    spinning = False
    try:
        while True:
            timeout = 0 if waiting or spinning else (idle_for if worker.deferred else -1)
            events = poller.poll(timeout)
            if spinning and not events and not waiting:
                spinning = spin.keep(time.monotonic())
                continue
            if not events and not waiting and worker.deferred:
                idle_for = IDLE_WORK_AFTER_S if worker.do_deferred() else WARM_TURN_S
            elif events:
                idle_for = IDLE_WORK_AFTER_S  # its idle time counts again from here
            for fd, _ in events:
                if fd == control_fd:
                    frame = read_frame(proto_in)
                    if frame is None or not worker.control(frame[0], frame[1], proto_out):
                        return 0
                elif fd == listener_fd:
                    conn, _addr = listener.accept()
                    conns[conn.fileno()] = (conn, _Reply(conn))
                    poller.register(conn.fileno(), select.EPOLLIN)
                elif fd in conns:
                    take(fd)
            if not waiting:
                continue
            _, _, fd = heapq.heappop(waiting)
            if fd not in calls:
                continue  # dropped while it waited
            msg, body = calls.pop(fd)
            reply = conns[fd][1]
            try:
                if (late := worker.refusal(msg, now=time.monotonic())) is not None:
                    write_frame(reply, late)
                else:
                    worker.run(msg, body, reply, watch=fd)
                    spinning = spin.start(time.monotonic())
            except OSError:  # the front went away meanwhile
                drop(fd)
    finally:
        poller.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
