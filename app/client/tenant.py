"""Tenant calls (API key): functions, invocations, kernels, usage."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from app.api.schemas import FunctionOut, InvocationOut, InvocationPage, KernelOut, UsageOut
from app.client.base import BaseClient, segment

_functions = TypeAdapter(list[FunctionOut])
_kernels = TypeAdapter(list[KernelOut])

UPLOAD_CHUNK = 256 * 1024

# (bytes sent, bytes in all); called after every chunk, the last call when the upload is done
Progress = Callable[[int, int], None]
Query = Mapping[str, str] | Sequence[tuple[str, str]] | None


def _pairs(query: Query) -> tuple[tuple[str, str], ...]:
    """A query as the pairs httpx's typing accepts from any of the forms `Query` allows."""
    return tuple(query.items()) if isinstance(query, Mapping) else tuple(query or ())


@dataclass(frozen=True)
class StreamEvent:
    event: str  # "output" (data: stdout text) or "end" (outcome: invocation_id, status, exit_code, error)
    data: str
    outcome: dict[str, Any] | None = None


@dataclass(frozen=True)
class Deployment:
    function: FunctionOut
    created: bool  # False: a new version of an existing function (or the same bytes again)


@dataclass(frozen=True)
class InvokeResult:
    output: bytes  # the guest's stdout
    invocation_id: str
    content_type: str


def _upload(data: bytes, progress: Progress | None) -> Iterator[bytes]:
    total = len(data)
    for start in range(0, total, UPLOAD_CHUNK):
        chunk = data[start : start + UPLOAD_CHUNK]
        yield chunk
        if progress is not None:
            progress(start + len(chunk), total)


class TensorWasmClient(BaseClient):
    # -- functions --------------------------------------------------------------------------
    def deploy(
        self,
        name: str,
        module: bytes,
        *,
        env: Mapping[str, str] | None = None,
        content_type: str | None = None,
        timeout_ms: int | None = None,
        progress: Progress | None = None,
    ) -> Deployment:
        """Upload a module (Wasm binary, or WAT text) as a new function or a new version; the
        server validates and compiles it before it answers."""
        params: list[tuple[str, str]] = [("env", f"{k}={v}") for k, v in (env or {}).items()]
        if content_type is not None:
            params.append(("content_type", content_type))
        if timeout_ms is not None:
            params.append(("timeout_ms", str(timeout_ms)))
        request = self._http.build_request(
            "PUT",
            f"/v1/functions/{segment(name)}",
            params=tuple(params),  # httpx's typing takes a list of pairs only of its own union of value types
            content=_upload(module, progress),
            headers={"Content-Type": "application/wasm", "Content-Length": str(len(module))},
        )
        r = self._send(request)
        return Deployment(FunctionOut.model_validate(r.json()), created=r.status_code == 201)

    def list_functions(self) -> list[FunctionOut]:
        return _functions.validate_python(self._request("GET", "/v1/functions").json())

    def get_function(self, name: str) -> FunctionOut:
        return FunctionOut.model_validate(self._request("GET", f"/v1/functions/{segment(name)}").json())

    def delete_function(self, name: str) -> None:
        self._request("DELETE", f"/v1/functions/{segment(name)}")

    # -- invoking ---------------------------------------------------------------------------
    def invoke(self, name: str, data: bytes = b"", *, query: Query = None) -> InvokeResult:
        """Run the function once: ``data`` is its stdin, the result holds its stdout."""
        r = self._request("POST", f"/v1/functions/{segment(name)}/invoke", content=data, params=query)
        return InvokeResult(r.content, r.headers.get("X-Invocation-Id", ""), r.headers.get("Content-Type", ""))

    @contextmanager
    def invoke_stream(self, name: str, data: bytes = b"", *, query: Query = None) -> Iterator[Iterator[bytes]]:
        """Run the function and yield its stdout in pieces as the guest writes them (raw
        stream); the outcome lands in the invocation record."""
        params = (*_pairs(query), ("stream", "raw"))
        request = self._http.build_request("POST", f"/v1/functions/{segment(name)}/invoke", content=data, params=params)
        response = self._send(request, stream=True)
        try:
            yield response.iter_raw()
        finally:
            response.close()

    def invoke_events(self, name: str, data: bytes = b"", *, query: Query = None) -> Iterator[StreamEvent]:
        """Run the function as a server-sent event stream: its stdout as UTF-8 text while the
        guest writes it, then one ``end`` event with the invocation's outcome."""
        request = self._http.build_request(
            "POST", f"/v1/functions/{segment(name)}/invoke", content=data, params=_pairs(query), headers={"Accept": "text/event-stream"}
        )
        response = self._send(request, stream=True)
        try:
            event, lines = None, []
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[len("event: "):]
                elif line.startswith("data: "):
                    lines.append(line[len("data: "):])
                elif line == "" and event is not None:
                    text = "\n".join(lines)
                    yield StreamEvent(event, text, json.loads(text) if event == "end" else None)
                    event, lines = None, []
        finally:
            response.close()

    def submit(self, name: str, data: bytes = b"", *, idempotency_key: str | None = None, query: Query = None) -> InvocationOut:
        """Queue an asynchronous invocation; returns its record (status ``queued``)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        r = self._request("POST", f"/v1/functions/{segment(name)}/invocations", content=data, params=query, headers=headers)
        return InvocationOut.model_validate(r.json())

    # -- invocation records -----------------------------------------------------------------
    def list_invocations(
        self, *, function: str | None = None, status: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> InvocationPage:
        """One page, newest first; pass the page's ``next_cursor`` as ``cursor`` for the next."""
        given = {"function": function, "status": status, "limit": limit, "cursor": cursor}
        params: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        return InvocationPage.model_validate(self._request("GET", "/v1/invocations", params=params).json())

    def wait(self, invocation_id: str, *, poll_s: float = 0.25, on_status: Callable[[InvocationOut], None] | None = None) -> InvocationOut:
        """Poll an invocation until it has ended; `on_status` sees each new status."""
        seen = None
        while True:
            record = self.get_invocation(invocation_id)
            if record.status != seen and on_status is not None:
                on_status(record)
            seen = record.status
            if record.status.ended:
                return record
            time.sleep(poll_s)

    def get_invocation(self, invocation_id: str) -> InvocationOut:
        return InvocationOut.model_validate(self._request("GET", f"/v1/invocations/{segment(invocation_id)}").json())

    def invocation_output(self, invocation_id: str) -> bytes:
        return self._request("GET", f"/v1/invocations/{segment(invocation_id)}/output").content

    def cancel_invocation(self, invocation_id: str) -> InvocationOut:
        r = self._request("POST", f"/v1/invocations/{segment(invocation_id)}/cancel")
        return InvocationOut.model_validate(r.json())

    # -- kernels ----------------------------------------------------------------------------
    def put_kernel(self, name: str, source: str) -> KernelOut:
        r = self._request(
            "PUT", f"/v1/kernels/{segment(name)}", content=source.encode(), headers={"Content-Type": "text/plain"}
        )
        return KernelOut.model_validate(r.json())

    def list_kernels(self) -> list[KernelOut]:
        return _kernels.validate_python(self._request("GET", "/v1/kernels").json())

    def get_kernel(self, name: str) -> KernelOut:
        return KernelOut.model_validate(self._request("GET", f"/v1/kernels/{segment(name)}").json())

    def delete_kernel(self, name: str) -> None:
        self._request("DELETE", f"/v1/kernels/{segment(name)}")

    # -- usage ------------------------------------------------------------------------------
    def usage(self) -> UsageOut:
        return UsageOut.model_validate(self._request("GET", "/v1/usage").json())
