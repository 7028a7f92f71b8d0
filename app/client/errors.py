"""The one exception of the client: the server's error envelope, or a transport failure."""

from __future__ import annotations

from typing import Any

import httpx


class TensorWasmError(Exception):
    """A request failed. ``code`` and ``message`` come from the server's error envelope
    (``{"error": {"code", "message", ...}}``); ``status`` is the HTTP status (0 when the server
    could not be reached); ``details`` holds the envelope's other fields (e.g. ``exit_code``,
    ``stderr_tail`` of a guest error)."""

    def __init__(
        self, status: int, code: str, message: str, details: dict[str, Any] | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}
        self.retry_after = retry_after

    def __str__(self) -> str:
        where = f"HTTP {self.status}" if self.status else "no response"
        return f"{self.message} ({self.code}, {where})"

    @classmethod
    def from_response(cls, response: httpx.Response) -> TensorWasmError:
        retry = response.headers.get("Retry-After")
        try:
            retry_after = float(retry) if retry is not None else None
        except ValueError:
            retry_after = None
        try:
            error = response.json()["error"]
            code, message = str(error["code"]), str(error["message"])
        except (ValueError, KeyError, TypeError):  # not the envelope: a proxy, or not this server
            text = response.text.strip()[:500] or response.reason_phrase
            return cls(response.status_code, f"http_{response.status_code}", text, retry_after=retry_after)
        details = {k: v for k, v in error.items() if k not in ("code", "message")}
        return cls(response.status_code, code, message, details, retry_after)
