"""Streamed invocations against a real node (`tensorwasm serve`): SSE events and raw chunks
arrive as the guest writes, and a client that goes away stops the guest (`cancelled`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import ADMIN, Node, fresh_database, wat


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("stream-node")
    url, drop = fresh_database(tmp)
    n = Node(url, tmp / "data").start()
    yield n
    n.stop()
    drop()


def tenant(node: Node, **quota: int) -> dict[str, str]:
    import uuid

    with httpx.Client(base_url=node.url, timeout=30) as c:
        r = c.post("/v1/admin/tenants", json={"name": f"s-{uuid.uuid4().hex[:10]}", "quota": quota}, headers=ADMIN)
        tid = r.json()["id"]
        key = {"Authorization": f"Bearer {c.post(f'/v1/admin/tenants/{tid}/api-keys', headers=ADMIN).json()['key']}"}
        for name in ("write_then_spin", "utf8_lines", "exit3", "flood"):
            r = c.put(f"/v1/functions/{name}", content=wat(name), headers={**key, "Content-Type": "application/wasm"})
            assert r.status_code == 201, r.text
    return key


def events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) pairs of an SSE stream, data lines joined with newlines."""
    name, data = None, []
    for line in lines:
        if line == "":
            if name is not None:
                yield name, "\n".join(data)
            name, data = None, []
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])


def record(node: Node, key: dict, inv: str, status: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(f"{node.url}/v1/invocations/{inv}", headers=key)
        if r.status_code == 200 and r.json()["status"] == status:
            return r.json()
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)


def test_sse_text_split_at_utf8_boundaries_then_end(node: Node) -> None:
    key = tenant(node)
    with httpx.stream("POST", f"{node.url}/v1/functions/utf8_lines/invoke", headers={**key, "Accept": "text/event-stream"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = list(events(r.iter_lines()))
    inv = r.headers["x-invocation-id"]
    outputs = [d for e, d in got if e == "output"]
    assert "".join(outputs) == "héllo\nwörld\n"  # the split "é" never reaches the client half-made
    assert outputs[0] == "h" and [e for e, _ in got].count("end") == 1 and got[-1][0] == "end"
    assert json.loads(got[-1][1]) == {"invocation_id": inv, "status": "succeeded", "exit_code": 0, "error": None}
    rec = record(node, key, inv, "succeeded")
    assert rec["mode"] == "stream"


def test_sse_end_event_carries_guest_error(node: Node) -> None:
    key = tenant(node)
    with httpx.stream("POST", f"{node.url}/v1/functions/exit3/invoke", headers={**key, "Accept": "text/event-stream"}) as r:
        got = list(events(r.iter_lines()))
    assert got[0] == ("output", "partial output\n")
    end = json.loads(got[-1][1])
    assert end["status"] == "guest_error" and end["exit_code"] == 3 and "3" in end["error"]


def test_first_line_arrives_while_guest_runs_and_disconnect_cancels(node: Node) -> None:
    """The guest writes a line and then spins until its 30 s limit: the client reads the line
    while the guest is still running, goes away, and the guest is stopped and recorded
    `cancelled` (long before the limit: the record's end comes from the disconnect)."""
    key = tenant(node, timeout_ms=30_000, max_concurrency=1)
    for kind in ("sse", "raw"):
        params = {"stream": "raw"} if kind == "raw" else {}
        headers = {**key, **({"Accept": "text/event-stream"} if kind == "sse" else {})}
        with httpx.stream("POST", f"{node.url}/v1/functions/write_then_spin/invoke", params=params, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            inv = r.headers["x-invocation-id"]
            if kind == "raw":
                raw = r.iter_raw()  # held: a dropped iterator closes the response
                assert next(raw) == b"first line\n"
            else:
                lines = r.iter_lines()
                assert next(lines) == "event: output" and next(lines) == "data: first line"
            # the guest is still running: its record is written only when it ends
            r2 = httpx.get(f"{node.url}/v1/invocations/{inv}", headers=key)
            assert r2.status_code == 404, r2.text
        rec = record(node, key, inv, "cancelled")
        assert rec["mode"] == "stream" and rec["duration_ms"] < 30_000
    # the worker was freed: the tenant (max_concurrency 1) runs its next call at once
    r = httpx.post(f"{node.url}/v1/functions/utf8_lines/invoke", headers=key, timeout=60)
    assert r.status_code == 200 and r.text == "héllo\nwörld\n"


def test_stdout_cap_applies_to_a_stream(node: Node) -> None:
    key = tenant(node)
    total = 0
    with httpx.stream("POST", f"{node.url}/v1/functions/flood/invoke", params={"stream": "raw"}, headers=key, timeout=60) as r:
        inv = r.headers["x-invocation-id"]
        for chunk in r.iter_raw():
            total += len(chunk)
    assert total <= 16 * 1024 * 1024  # the default cap; the write that crossed it was not sent
    rec = record(node, key, inv, "output_limit")
    assert "limit" in rec["error"]


def test_stream_of_unknown_function_is_404_json(node: Node) -> None:
    key = tenant(node)
    r = httpx.post(f"{node.url}/v1/functions/nope/invoke", headers={**key, "Accept": "text/event-stream"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
