"""Tenant calls (API key): functions, invocations, kernels, usage."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import TypeAdapter

from app.api.schemas import (
    CallbackSecretOut,
    FunctionOut,
    FunctionVersionOut,
    InvocationOut,
    InvocationPage,
    KernelOut,
    LogLineOut,
    LogPage,
    SecretOut,
    UsageOut,
)
from app.client.base import BaseClient, segment

_functions = TypeAdapter(list[FunctionOut])
_kernels = TypeAdapter(list[KernelOut])
_versions = TypeAdapter(list[FunctionVersionOut])
_secrets = TypeAdapter(list[SecretOut])

UPLOAD_CHUNK = 256 * 1024

# (bytes sent, bytes in all); called after every chunk, the last call when the upload is done
Progress = Callable[[int, int], None]
Query = Mapping[str, str] | Sequence[tuple[str, str]] | None


def _pairs(query: Query) -> tuple[tuple[str, str], ...]:
    """A query as the pairs httpx's typing accepts from any of the forms `Query` allows."""
    return tuple(query.items()) if isinstance(query, Mapping) else tuple(query or ())


def _version_header(version: int | None, headers: dict[str, str] | None) -> dict[str, str] | None:
    """`headers` with the version the call pins (X-Function-Version) when given."""
    return headers if version is None else {**(headers or {}), "X-Function-Version": str(version)}


def _args_header(args: Sequence[str] | None, headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """`headers` with the call's own arguments (X-Function-Args) when given."""
    if args is None:
        return headers
    return {**(headers or {}), "X-Function-Args": json.dumps(list(args))}


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
        args: Sequence[str] | None = None,
        cgi: bool | None = None,
        scratch: bool | None = None,
        content_type: str | None = None,
        timeout_ms: int | None = None,
        max_attempts: int | None = None,
        secrets: Sequence[str] | None = None,
        progress: Progress | None = None,
    ) -> Deployment:
        """Upload a module (Wasm binary, or WAT text) as a new function or a new version; the
        server validates and compiles it before it answers. `args`: the default argv after the
        function's name; `cgi`: add the request variables to its environment; `scratch`: each
        call gets a writable copy of its files; `max_attempts`: runs of an async invocation whose
        node is lost mid-run; `secrets`: names of the tenant's secrets the guest gets as variables
        (empty: none). None leaves a setting as it is. A change makes a new version."""
        params: list[tuple[str, str]] = [("env", f"{k}={v}") for k, v in (env or {}).items()]
        params += [("arg", a) for a in (args or ())]
        for flag, value in (("cgi", cgi), ("scratch", scratch)):
            if value is not None:
                params.append((flag, "true" if value else "false"))
        if content_type is not None:
            params.append(("content_type", content_type))
        if timeout_ms is not None:
            params.append(("timeout_ms", str(timeout_ms)))
        if max_attempts is not None:
            params.append(("max_attempts", str(max_attempts)))
        if secrets is not None:
            params += [("secret", s) for s in secrets] or [("secret", "")]
        request = self._http.build_request(
            "PUT",
            f"/v1/functions/{segment(name)}",
            params=tuple(params),  # httpx's typing takes a list of pairs only of its own union of value types
            content=_upload(module, progress),
            headers={"Content-Type": "application/wasm", "Content-Length": str(len(module))},
        )
        r = self._send(request)
        return Deployment(FunctionOut.model_validate(r.json()), created=r.status_code == 201)

    def put_files(self, name: str, archive: bytes, *, progress: Progress | None = None) -> FunctionOut:
        """Give the function the files of a tar archive, which its guest sees at `/`."""
        request = self._http.build_request(
            "PUT",
            f"/v1/functions/{segment(name)}/files",
            content=_upload(archive, progress),
            headers={"Content-Type": "application/x-tar", "Content-Length": str(len(archive))},
        )
        return FunctionOut.model_validate(self._send(request).json())

    def list_functions(self) -> list[FunctionOut]:
        return _functions.validate_python(self._request("GET", "/v1/functions").json())

    def get_function(self, name: str) -> FunctionOut:
        return FunctionOut.model_validate(self._request("GET", f"/v1/functions/{segment(name)}").json())

    def delete_function(self, name: str) -> None:
        self._request("DELETE", f"/v1/functions/{segment(name)}")

    def list_versions(self, name: str) -> list[FunctionVersionOut]:
        """The versions the function keeps, oldest first (`active`: the one calls run)."""
        return _versions.validate_python(self._request("GET", f"/v1/functions/{segment(name)}/versions").json())

    def rollback(self, name: str, version: int) -> FunctionOut:
        """Make a kept version the active one from the next call on."""
        return FunctionOut.model_validate(
            self._request("POST", f"/v1/functions/{segment(name)}/rollback", json={"version": version}).json()
        )

    # -- secrets ----------------------------------------------------------------------------
    def put_secret(self, name: str, value: bytes) -> tuple[SecretOut, bool]:
        """Keep a secret (created: True); its value is never shown again."""
        r = self._request(
            "PUT", f"/v1/secrets/{segment(name)}", content=value, headers={"Content-Type": "application/octet-stream"}
        )
        return SecretOut.model_validate(r.json()), r.status_code == 201

    def list_secrets(self) -> list[SecretOut]:
        return _secrets.validate_python(self._request("GET", "/v1/secrets").json())

    def delete_secret(self, name: str) -> None:
        self._request("DELETE", f"/v1/secrets/{segment(name)}")

    # -- invoking ---------------------------------------------------------------------------
    def invoke(
        self, name: str, data: bytes = b"", *, query: Query = None, args: Sequence[str] | None = None, version: int | None = None
    ) -> InvokeResult:
        """Run the function once: ``data`` is its stdin, the result holds its stdout; ``args``
        replace its default arguments for this call; ``version`` pins one of its versions."""
        r = self._request(
            "POST", f"/v1/functions/{segment(name)}/invoke", content=data, params=query,
            headers=_version_header(version, _args_header(args)),
        )
        return InvokeResult(r.content, r.headers.get("X-Invocation-Id", ""), r.headers.get("Content-Type", ""))

    @contextmanager
    def invoke_stream(
        self, name: str, data: bytes = b"", *, query: Query = None, args: Sequence[str] | None = None, version: int | None = None
    ) -> Iterator[Iterator[bytes]]:
        """Run the function and yield its stdout in pieces as the guest writes them (raw
        stream); the outcome lands in the invocation record."""
        params = (*_pairs(query), ("stream", "raw"))
        request = self._http.build_request(
            "POST", f"/v1/functions/{segment(name)}/invoke", content=data, params=params,
            headers=_version_header(version, _args_header(args)),
        )
        response = self._send(request, stream=True)
        try:
            yield response.iter_raw()
        finally:
            response.close()

    def invoke_events(
        self, name: str, data: bytes = b"", *, query: Query = None, args: Sequence[str] | None = None, version: int | None = None
    ) -> Iterator[StreamEvent]:
        """Run the function as a server-sent event stream: its stdout as UTF-8 text while the
        guest writes it, then one ``end`` event with the invocation's outcome."""
        request = self._http.build_request(
            "POST", f"/v1/functions/{segment(name)}/invoke", content=data, params=_pairs(query),
            headers=_version_header(version, _args_header(args, {"Accept": "text/event-stream"})),
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

    def submit(
        self, name: str, data: bytes = b"", *, idempotency_key: str | None = None, query: Query = None,
        args: Sequence[str] | None = None, callback_url: str | None = None, version: int | None = None,
    ) -> InvocationOut:
        """Queue an asynchronous invocation; returns its record (status ``queued``). `callback_url`:
        its final record is POSTed there, signed, when it ends."""
        headers = _args_header(args, {"Idempotency-Key": idempotency_key} if idempotency_key else None)
        if callback_url:
            headers = {**(headers or {}), "X-Callback-Url": callback_url}
        headers = _version_header(version, headers)
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

    def invocation_output(self, invocation_id: str, *, any_status: bool = False) -> bytes:
        """The stored stdout of a succeeded async invocation; one that ended otherwise raises
        `TensorWasmError` as a synchronous call that ended so would (guest_error with exit_code
        and stderr_tail, timeout, ...), unless `any_status` asks for whatever stdout it stored."""
        params = {"any": "true"} if any_status else None
        return self._request("GET", f"/v1/invocations/{segment(invocation_id)}/output", params=params).content

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

    # -- logs and callbacks -----------------------------------------------------------------
    def logs(self, name: str, *, limit: int | None = None) -> list[LogLineOut]:
        """The newest lines the function's calls wrote to stderr, oldest first."""
        params = {"limit": limit} if limit else None
        return LogPage.model_validate(self._request("GET", f"/v1/functions/{segment(name)}/logs", params=params).json()).lines

    def follow_logs(self, name: str, *, limit: int | None = None) -> Iterator[LogLineOut]:
        """The newest lines, then each new one as calls end, until the caller stops iterating."""
        params: dict[str, Any] = {"follow": "1", **({"limit": limit} if limit else {})}
        request = self._http.build_request("GET", f"/v1/functions/{segment(name)}/logs", params=params, timeout=httpx.Timeout(None, connect=10))
        response = self._send(request, stream=True)
        try:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    yield LogLineOut.model_validate_json(line[len("data: "):])
        finally:
            response.close()

    def callback_secret(self, *, rotate: bool = False) -> CallbackSecretOut:
        """The key callbacks are signed with; `rotate`: replace it first."""
        return CallbackSecretOut.model_validate(self._request("POST" if rotate else "GET", "/v1/callbacks/secret").json())

    # -- usage ------------------------------------------------------------------------------
    def usage(self) -> UsageOut:
        return UsageOut.model_validate(self._request("GET", "/v1/usage").json())
