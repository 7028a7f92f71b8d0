"""A worker's socket for fronts (app/worker/main.py `_serve_fronts`), served on a thread with a
runner that echoes stdin: a call's frame read whole however it arrives, its reply one frame,
and a connection that breaks the protocol dropped without stopping the worker."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.contract.frames import HEAD, decode_header, encode
from app.contract.messages import LeaseToken, Result, Run, RunStatus, lease_mac
from app.worker.main import _serve_fronts, _Worker

SECRET = b"k" * 32


class _EchoRunner:
    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(self, msg: Run, stdin: bytes, watch: int | None) -> Any:
        self.ran.append(msg.invocation_id)
        return SimpleNamespace(status=RunStatus.OK, stdout=stdin, stderr=b"", exit_code=0, error=None, duration_ms=0.1, host={}, spans=None)

    def finish(self) -> None:
        pass

    def prepare(self, msg: Run) -> None:
        pass


class _Page:
    def set(self, field: str, value: int) -> None:
        pass


@pytest.fixture
def served(tmp_path: Path) -> Any:
    runner = _EchoRunner()
    host = SimpleNamespace(backend=SimpleNamespace(deferred_used=False), launches_total=0)
    worker = _Worker(runner=runner, host=host, memory=SimpleNamespace(scrub=lambda: None), stats=_Page())
    worker.deferred = False
    worker.bind_tokens("t1", "w1", SECRET)
    r, w = os.pipe()
    path = str(tmp_path / "w.sock")
    t = threading.Thread(target=_serve_fronts, args=(worker, os.fdopen(r, "rb"), open(os.devnull, "wb"), path), daemon=True)  # noqa: SIM115
    t.start()
    deadline = time.monotonic() + 5
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    yield path, runner
    os.close(w)  # the control pipe closed: the worker ends
    t.join(5)
    assert not t.is_alive()


def _frame(invocation_id: str, body: bytes) -> bytes:
    mac = lease_mac(SECRET, "", "w1", "t1")
    run = Run(invocation_id, "f", "sha", {}, 1000, 1 << 20, 1 << 22, 0, lease=LeaseToken("", "t1", mac), start_by=time.monotonic() + 30)
    return b"".join(bytes(p) for p in encode(run, body))


def _reply(sock: socket.socket) -> tuple[Any, bytes]:
    data = b""
    while True:
        chunk = sock.recv(1 << 20)
        assert chunk, "the worker closed the connection"
        data += chunk
        if len(data) >= HEAD.size:
            hlen, blen = HEAD.unpack_from(data)
            if len(data) >= HEAD.size + hlen + blen:
                assert len(data) == HEAD.size + hlen + blen  # one frame, nothing after it
                return decode_header(data[HEAD.size : HEAD.size + hlen]), data[HEAD.size + hlen :]


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def test_calls_on_one_connection_are_each_answered_with_one_frame(served: Any) -> None:
    path, runner = served
    with _connect(path) as sock:
        for i in range(3):
            sock.sendall(_frame(f"inv-{i}", b"hello %d" % i))
            msg, body = _reply(sock)
            assert isinstance(msg, Result) and msg.status == RunStatus.OK and body == b"hello %d" % i
    assert runner.ran == ["inv-0", "inv-1", "inv-2"]


def test_a_frame_that_arrives_in_pieces_is_read_whole(served: Any) -> None:
    path, _ = served
    body = os.urandom(3 << 20)  # larger than a read, and than the socket's buffer
    raw = _frame("inv-big", body)
    with _connect(path) as sock:
        sock.sendall(raw[:3])  # not even the frame's lengths yet
        time.sleep(0.05)
        sender = threading.Thread(target=sock.sendall, args=(raw[3:],))
        sender.start()
        msg, out = _reply(sock)
        sender.join(5)
    assert isinstance(msg, Result) and msg.stdout_len == len(body) and out == body


def test_a_second_frame_before_the_answer_drops_that_connection_only(served: Any) -> None:
    path, runner = served
    with _connect(path) as bad:
        bad.sendall(_frame("inv-a", b"a") + _frame("inv-b", b"b"))
        assert bad.recv(1 << 16) == b""  # closed, nothing run
    with _connect(path) as good:
        good.sendall(_frame("inv-c", b"c"))
        msg, body = _reply(good)
        assert isinstance(msg, Result) and body == b"c"
    assert runner.ran == ["inv-c"]
