"""A call's own arguments: the `X-Function-Args` header (a JSON array of strings), which replaces
the function's default argv after its name for that call; and the version it pins
(`X-Function-Version`), which runs instead of the active one."""

from __future__ import annotations

import json

from starlette.requests import Request

from app.api.errors import ApiError
from app.services.guest_inputs import check_args

HEADER = "x-function-args"
VERSION_HEADER = "x-function-version"
MAX_VERSION = 2**31 - 1  # the column's range


def call_args(request: Request) -> list[str] | None:
    return parse_args(request.headers.get(HEADER))


def call_version(request: Request) -> int | None:
    return parse_version(request.headers.get(VERSION_HEADER))


def parse_args(raw: str | None) -> list[str] | None:
    """The call's arguments, or None when it passes none (the function's defaults apply).
    Not JSON: 400; not an array of strings within the bounds: 422."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        raise ApiError(
            400, "bad_request", 'X-Function-Args must be a JSON array of strings, e.g. ["--verbose", "input.txt"]'
        ) from None
    if not isinstance(value, list):
        raise ApiError(422, "validation_error", f"X-Function-Args must be a JSON array of strings, got a {type(value).__name__}")
    return check_args(value, "X-Function-Args")


def parse_version(raw: str | None) -> int | None:
    """The version the call pins, or None (the active one runs). Not a number: 400; out of
    range: 422. A version the function does not keep answers 404 version_not_found later."""
    if raw is None:
        return None
    text = raw.strip()
    if not text.isascii() or not text.isdigit():
        raise ApiError(400, "bad_request", "X-Function-Version must be a version number, e.g. 3 (see GET /v1/functions/{name}/versions)")
    number = int(text)
    if not 1 <= number <= MAX_VERSION:
        raise ApiError(422, "validation_error", f"X-Function-Version must be between 1 and {MAX_VERSION}")
    return number
