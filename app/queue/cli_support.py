"""The command line's async and streaming commands, over the HTTP API (never the database).

`tensorwasm invoke NAME --async [--wait]`, `tensorwasm invoke NAME --stream` and
`tensorwasm invocations get|output|cancel ID` call these with an `httpx.Client` whose base URL
and `Authorization` header come from TENSORWASM_URL / TENSORWASM_API_KEY (or flags). Each
returns the process exit status: 0 when the invocation succeeded (or the request did), 1
otherwise, with the server's message on stderr.
"""

from __future__ import annotations

import json
import sys
import time
from typing import BinaryIO, TextIO

import httpx

ENDED = {"succeeded", "guest_error", "timeout", "output_limit", "device_error", "worker_crashed",
         "internal_error", "client_closed", "cancelled", "interrupted", "not_found"}


def _fail(r: httpx.Response, err: TextIO) -> int:
    try:
        e = r.json()["error"]
        print(f"error: {e['message']} ({e['code']}, HTTP {r.status_code})", file=err)
    except (ValueError, KeyError, TypeError):
        print(f"error: HTTP {r.status_code}: {r.text[:500]}", file=err)
    return 1


def invoke_async(
    client: httpx.Client, name: str, body: bytes, *, wait: bool = False, idempotency_key: str | None = None,
    out: BinaryIO | None = None, err: TextIO = sys.stderr, poll_s: float = 0.25,
) -> int:
    """Queue an invocation and print its id; with `wait`, wait for its end and write its output."""
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    r = client.post(f"/v1/functions/{name}/invocations", content=body, headers=headers)
    if r.status_code != 202:
        return _fail(r, err)
    inv = r.json()["id"]
    if not wait:
        (out or sys.stdout.buffer).write(f"{inv}\n".encode())
        return 0
    print(f"queued {inv}", file=err)
    status = r.json()["status"]
    while status not in ENDED:
        time.sleep(poll_s)
        r = client.get(f"/v1/invocations/{inv}")
        if r.status_code != 200:
            return _fail(r, err)
        if r.json()["status"] != status:
            status = r.json()["status"]
            print(status, file=err)
    return invocation_output(client, inv, out=out, err=err)


def invoke_stream(client: httpx.Client, name: str, body: bytes, *, out: BinaryIO | None = None, err: TextIO = sys.stderr) -> int:
    """Write the guest's stdout as it is produced (the raw stream); the outcome goes to stderr."""
    out = out or sys.stdout.buffer
    with client.stream("POST", f"/v1/functions/{name}/invoke", content=body, headers={"Accept": "text/event-stream"}) as r:
        if r.status_code != 200:
            r.read()
            return _fail(r, err)
        end: dict[str, object] = {}
        event, data = None, []
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and event is not None:
                text = "\n".join(data)
                if event == "output":
                    out.write(text.encode())
                    out.flush()
                elif event == "end":
                    end = json.loads(text)
                event, data = None, []
    if end.get("status") == "succeeded":
        return 0
    print(f"invocation {end.get('invocation_id')} ended {end.get('status', 'without an end event')}: {end.get('error')}", file=err)
    return 1


def invocation_get(client: httpx.Client, invocation_id: str, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    r = client.get(f"/v1/invocations/{invocation_id}")
    if r.status_code != 200:
        return _fail(r, err)
    print(json.dumps(r.json(), indent=2), file=out)
    return 0


def invocation_output(client: httpx.Client, invocation_id: str, *, out: BinaryIO | None = None, err: TextIO = sys.stderr) -> int:
    r = client.get(f"/v1/invocations/{invocation_id}/output")
    if r.status_code != 200:
        return _fail(r, err)
    (out or sys.stdout.buffer).write(r.content)
    status = r.headers.get("x-invocation-status", "")
    if status != "succeeded":
        print(f"invocation {invocation_id} ended {status}", file=err)
        return 1
    return 0


def invocation_cancel(client: httpx.Client, invocation_id: str, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    r = client.post(f"/v1/invocations/{invocation_id}/cancel")
    if r.status_code != 200:
        return _fail(r, err)
    print(r.json()["status"], file=out)
    return 0
