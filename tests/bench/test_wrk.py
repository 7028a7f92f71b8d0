"""The load generator wrapper: wrk's figures come back as numbers, replies counted by status."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from app.bench.node import bare_echo, bare_relay
from app.bench.wrk import run_wrk, wrk_path

pytestmark = pytest.mark.skipif(wrk_path() is None, reason="wrk is not installed (`apt-get install wrk`; .ci/run installs it)")


def test_wrk_counts_replies_by_status_against_the_bare_echo_app() -> None:
    with bare_echo(1) as url:
        ok = run_wrk(url, connections=2, seconds=1, method="POST", body="hi")
        missing = run_wrk(url.replace("/echo", "/nowhere"), connections=1, seconds=1)
    assert ok.requests > 0 and ok.ok == ok.requests and ok.other == 0 and ok.socket_errors == 0
    assert 0 < ok.p50_ms <= ok.p99_ms <= ok.max_ms
    assert missing.requests > 0 and missing.ok == 0 and missing.other == missing.requests  # 404s


def test_the_one_hop_baseline_echoes_through_its_other_process() -> None:
    with bare_relay(2) as url:
        body = bytes(range(256)) * 300  # more than one socket read on both sides
        assert httpx.post(url, content=body, timeout=10).content == body
        ok = run_wrk(url, connections=4, seconds=1, method="POST", body="hi")
    assert ok.requests > 0 and ok.ok == ok.requests and ok.socket_errors == 0


@contextmanager
def _one_slow_reply(delay_s: float, slow_path: bytes | None = None, heads: list[bytes] | None = None) -> Iterator[str]:
    """A bare HTTP server answering at once, but its 500th request after `delay_s`; with
    `slow_path`, every request for that path after `delay_s` instead; each request's head kept in
    `heads` where given."""
    loop = asyncio.new_event_loop()
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                served += 1
                if heads is not None:
                    heads.append(head)
                path = head.split(b" ", 2)[1]
                if (served == 500 and slow_path is None) or path == slow_path:
                    await asyncio.sleep(delay_s)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(_close(server))
        loop.close()


async def _close(server: asyncio.Server) -> None:
    server.close()
    handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in handlers:
        task.cancel()
    await asyncio.gather(*handlers, return_exceptions=True)


def test_a_timed_run_reports_the_calls_made_where_wrk_corrects_for_the_ones_not_sent() -> None:
    with _one_slow_reply(0.2) as url:
        r = run_wrk(url, connections=1, seconds=2, timed=True)
    # enough calls that the one slow reply is past the timed p99 (a slow host makes fewer)
    assert r.requests > 500 and r.ok == r.requests
    assert r.max_ms >= 200  # the one slow reply
    # wrk adds a made-up sample per mean interval of that reply: its p99 is near the stall
    assert r.p99_ms >= 100
    assert r.timed_p99_ms is not None and r.timed_p99_ms < 20 and r.call_p99_ms == r.timed_p99_ms


def test_an_alternate_path_is_called_every_other_time_and_timed_apart() -> None:
    with _one_slow_reply(0.005, slow_path=b"/slow") as url:
        r = run_wrk(url, connections=1, seconds=1, timed=True, alternate="/slow")
    assert r.ok == r.requests > 20
    assert r.timed_p50_ms is not None and r.alternate_p50_ms is not None
    assert r.timed_p50_ms < 3 and r.alternate_p50_ms >= 5
    with pytest.raises(ValueError):
        run_wrk(url, connections=1, seconds=1, alternate="/slow")  # only timed runs alternate


def test_rotated_headers_take_turns_one_set_a_request() -> None:
    heads: list[bytes] = []
    sets = [{"Authorization": f"Bearer key{i}"} for i in range(4)]
    with _one_slow_reply(10.0, slow_path=b"/never", heads=heads) as url:
        r = run_wrk(url, connections=4, threads=2, seconds=1, rotate=sets)
        with pytest.raises(ValueError):
            run_wrk(url, connections=1, seconds=1, timed=True, rotate=sets)  # a timed run keeps its own request()
    assert r.ok == r.requests > 100 and r.socket_errors == 0
    keys = Counter(line.split(b" ")[-1] for head in heads for line in head.split(b"\r\n") if line.lower().startswith(b"authorization:"))
    assert set(keys) == {f"key{i}".encode() for i in range(4)}
    # each thread goes round the sets in turn: no set gets much more than its share
    assert max(keys.values()) - min(keys.values()) <= 2 * 4
    assert all(head.startswith(b"GET / ") and head.endswith(b"\r\n\r\n") for head in heads)


def test_the_guest_floor_runs_the_echo_guest_in_its_far_processes() -> None:
    with bare_relay(2, far=2, guest=True) as url:
        body = bytes(range(256)) * 300
        # one client's calls in a row keep to the first far process; wrk's four connections below
        # spread over both, each running its own guest
        assert [httpx.post(url, content=body, timeout=10).content for _ in range(4)] == [body] * 4
        assert httpx.post(url, content=b"", timeout=10).content == b""
        # the guest, not a plain echo, answers: its stdout is capped at 1 MiB, as a worker's run caps it
        with pytest.raises(httpx.HTTPError):
            httpx.post(url, content=b"x" * (2 << 20), timeout=10).raise_for_status()
        # its plain route takes the same hop to the same far process, which echoes without the guest
        assert httpx.post(f"{url}/plain", content=b"x" * (2 << 20), timeout=10).content == b"x" * (2 << 20)
        ok = run_wrk(url, connections=4, seconds=1, method="POST", body="hi")
    assert ok.requests > 0 and ok.ok == ok.requests and ok.socket_errors == 0
