"""The HTTP plumbing shared by the admin and tenant clients."""

from __future__ import annotations

from typing import Any, Self
from urllib.parse import quote, urlsplit

import httpx

from app import __version__
from app.client.errors import TensorWasmError

DEFAULT_URL = "http://127.0.0.1:8080"


def segment(value: str) -> str:
    """One path segment, escaped (names and ids never contain '/', but a typo might)."""
    return quote(value, safe="")


def check_url(url: str) -> str:
    """The server's base URL without a trailing slash; TensorWasmError (code ``invalid_url``)
    for anything but an http(s) URL with a host and a valid port."""
    try:
        parts = urlsplit(url.strip())
        _ = parts.port  # raises ValueError for a port that is not a number in range
        httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise TensorWasmError(0, "invalid_url", f"the server URL {url!r} is not valid ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TensorWasmError(0, "invalid_url", f"the server URL {url!r} is not an http:// or https:// URL with a host")
    return url.strip().rstrip("/")


def _reason(exc: BaseException) -> str:
    """A transport failure in a few words: its innermost cause (e.g. "[Errno 111] Connection
    refused"), without the exception class names httpx and httpcore stack up."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


class BaseClient:
    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        timeout: float = 120.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"User-Agent": f"tensorwasm-client/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.url = check_url(url)
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        try:
            response = self._http.send(request, stream=stream)
        except httpx.TimeoutException as exc:
            raise TensorWasmError(0, "timeout", f"{self.url} did not answer within {self.timeout:g} s ({_reason(exc)})") from exc
        except httpx.HTTPError as exc:
            raise TensorWasmError(0, "unreachable", f"cannot reach {self.url} ({_reason(exc)})") from exc
        if response.is_error:
            if stream:
                response.read()
                response.close()
            raise TensorWasmError.from_response(response)
        return response

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._send(self._http.build_request(method, path, **kwargs))
