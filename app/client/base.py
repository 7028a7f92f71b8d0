"""The HTTP plumbing shared by the admin and tenant clients."""

from __future__ import annotations

from typing import Any, Self
from urllib.parse import quote

import httpx

from app import __version__
from app.client.errors import TensorWasmError

DEFAULT_URL = "http://127.0.0.1:8080"


def segment(value: str) -> str:
    """One path segment, escaped (names and ids never contain '/', but a typo might)."""
    return quote(value, safe="")


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
        self.url = url.rstrip("/")
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
        except httpx.HTTPError as exc:
            raise TensorWasmError(0, "unreachable", f"cannot reach {self.url}: {exc}") from exc
        if response.is_error:
            if stream:
                response.read()
                response.close()
            raise TensorWasmError.from_response(response)
        return response

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._send(self._http.build_request(method, path, **kwargs))
