"""A fork server for workers: one process that imported the runtime, forking a worker per request.

A fresh interpreter pays for importing numpy, wasmtime and (on a GPU node) CuPy in every worker;
measured on an H200 host, a CUDA worker forked from a process that already imported them, with no
CUDA call made yet, is ready in 0.30-0.36 s instead of 1.05-1.64 s, 7 instead of 4.4 start per
second in parallel, and shares those pages (193 instead of 307 MiB proportional RSS). The fork server never touches CUDA, so each child creates its own
context from a clean driver state, on the device its own `CUDA_VISIBLE_DEVICES` names.

Hand-written rather than multiprocessing's forkserver because a worker's protocol pipes must come
back to the asyncio event loop as file descriptors (SCM_RIGHTS), its exit is watched through a
pidfd from that loop, and its environment is set per child before any import-time side effect.

Lifetimes: the fork server dies with the process that started it (parent-death signal), and every
worker dies with the fork server the same way, so nothing outlives the node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from app.runtime.environment import tenant_process_env
from app.worker.lifeline import arm_parent_death_signal

_MAX_MSG = 1 << 16


# -- the fork server process ---------------------------------------------------------------------
def _preload(backend: str) -> None:
    """Import everything a worker needs, without any call that would initialise CUDA."""
    import numpy  # noqa: F401
    import wasmtime  # noqa: F401

    import app.gpu.abi  # noqa: F401
    import app.gpu.cpu  # noqa: F401
    import app.runtime.runner  # noqa: F401
    import app.worker.main  # noqa: F401

    if backend in ("cuda", "auto"):
        with contextlib.suppress(Exception):  # no CuPy here: workers fall back as they would anyway
            import cupy  # noqa: F401

            import app.gpu.cuda  # noqa: F401


def _reap(_signum: int, _frame: Any) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _child(sock: socket.socket, argv: list[str], env: dict[str, str], stdin_r: int, stdout_w: int, server_pid: int) -> None:
    try:
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # die with the fork server (the worker's own lifeline also watches the node)
        arm_parent_death_signal()
        if os.getppid() != server_pid:
            os._exit(1)
        os.environ.update(env)
        os.dup2(stdin_r, 0)
        os.dup2(stdout_w, 1)
        os.close(stdin_r)
        os.close(stdout_w)
        from app.worker.main import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)


def serve(sock: socket.socket, backend: str) -> int:
    _preload(backend)
    # What the imports left is read-only for the children: out of the collector's sight, a
    # collection in a worker does not write to (and so copy) every page of it.
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the node's to handle
    sock.send(b'{"op":"ready"}')
    me = os.getpid()
    while True:
        msg = sock.recv(_MAX_MSG)
        if not msg:
            return 0  # the node closed its end
        req = json.loads(msg)
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(stdin_w)
            os.close(stdout_r)
            _child(sock, req["argv"], req.get("env", {}), stdin_r, stdout_w, me)
        os.close(stdin_r)
        os.close(stdout_w)
        try:
            socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [stdin_w, stdout_r])
        finally:
            os.close(stdin_w)
            os.close(stdout_r)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)
    # No watchdog thread here: this process forks, and a fork copies only the calling thread.
    arm_parent_death_signal()
    if os.getppid() != args.parent:
        return 1
    return serve(socket.socket(fileno=args.fd), args.backend)


# -- the node's side -----------------------------------------------------------------------------
@dataclass
class ForkedProcess:
    """The parts of asyncio.subprocess.Process a WorkerHandle uses, for a child of the fork server."""

    pid: int
    stdin: asyncio.StreamWriter
    stdout: asyncio.StreamReader
    _pidfd: int
    # the pipes' file objects, kept with the transports that use their descriptors
    _files: tuple[Any, ...] = ()
    returncode: int | None = None
    _exited: asyncio.Event | None = None

    def __post_init__(self) -> None:
        self._exited = asyncio.Event()
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        # Not our child, so no exit status: the fork server reaps it. -9 reads as "killed".
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self.stdin.close()  # nothing reads it any more; the stdout side closes at its EOF
        self.returncode = -signal.SIGKILL
        assert self._exited is not None
        self._exited.set()

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    async def wait(self) -> int:
        assert self._exited is not None
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """Starts the fork server (a fresh interpreter) and asks it for workers."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one request at a time on the socket
        self._starting = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def _start(self) -> None:
        # Popen runs on the event-loop thread: a parent-death signal follows the thread that
        # forked, and this one lives as long as the node.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            cmd = [sys.executable, "-m", "app.worker.forkserver", "--fd", str(theirs.fileno()), "--parent", str(os.getpid()), "--backend", self.backend]
            # its own session: a terminal's Ctrl-C is for the node, which stops its workers itself
            # the allowed environment only: every worker forked from it inherits it (no secret
            # of the node reaches a process that runs tenant code, app/runtime/environment.py)
            self._proc = subprocess.Popen(
                cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True, env=tenant_process_env()
            )
        ready = await asyncio.get_running_loop().run_in_executor(None, ours.recv, _MAX_MSG)
        if json.loads(ready or b"{}").get("op") != "ready":
            ours.close()
            raise RuntimeError(f"the worker fork server exited during start (code {self._proc.wait()})")
        self._sock = ours

    def _fork(self, argv: list[str], env: dict[str, str]) -> tuple[int, int, int]:
        with self._lock:
            if self._sock is None:
                raise RuntimeError("the worker fork server is not running")
            self._sock.send(json.dumps({"argv": argv, "env": env}).encode())
            msg, fds, _flags, _addr = socket.recv_fds(self._sock, _MAX_MSG, 2)
            if not msg or len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                raise RuntimeError("the worker fork server did not answer")
            return int(json.loads(msg)["pid"]), fds[0], fds[1]

    async def spawn(self, argv: list[str], env: dict[str, str] | None = None, limit: int = 1 << 20) -> ForkedProcess:
        loop = asyncio.get_running_loop()
        async with self._starting:
            if self._sock is None or not self.alive():
                self.close_sync()
                await self._start()
        pid, stdin_w, stdout_r = await loop.run_in_executor(None, self._fork, argv, env or {})
        pidfd = os.pidfd_open(pid)
        # uvloop (which uvicorn runs) closes a pipe's fd in libuv and then closes the file object
        # it was given as well: a second close of the same number, which takes the fd another
        # thread just opened in between (a fork reply's pipes, under churn). There the file object
        # must not own its fd; asyncio's own transports close the fd through the file object.
        owns = not type(loop).__module__.startswith("uvloop")
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        stdout_file = os.fdopen(stdout_r, "rb", buffering=0, closefd=owns)
        stdin_file = os.fdopen(stdin_w, "wb", buffering=0, closefd=owns)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), stdout_file)
        transport, protocol = await loop.connect_write_pipe(lambda: asyncio.streams.FlowControlMixin(loop=loop), stdin_file)
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        return ForkedProcess(pid, writer, reader, pidfd, (stdout_file, stdin_file))

    def close_sync(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


if __name__ == "__main__":
    sys.exit(main())
