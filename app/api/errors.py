"""The error envelope (docs/architecture.md, "Messages and errors"): every failure is {"error": {"code", "message"}}.

The one place where errors become HTTP: the domain errors of services and the queue
(app/errors.py) map to statuses through `DOMAIN_STATUS`; `ApiError` is for the refusals the API
layer makes itself (bodies, credentials, parameters only a router sees).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app.api.schemas import ErrorEnvelope
from app.contract.errors import NoCapacity, Rejected, SupervisorGone
from app.db.errors import unavailable
from app.errors import Conflict, DomainError, Forbidden, Gone, Invalid, LimitReached, NotFound, Unavailable

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A refusal of the API layer itself, with its status; services raise app.errors' kinds."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} not found")


# Each kind of domain error and its status; a subclass of a kind answers the kind's status.
DOMAIN_STATUS: Mapping[type[DomainError], int] = {
    NotFound: 404,
    Conflict: 409,
    Forbidden: 403,
    Invalid: 422,
    LimitReached: 429,
    Gone: 410,
    Unavailable: 503,
}


def domain_status(exc: DomainError) -> int | None:
    """The status of `exc`'s kind (its closest class in `DOMAIN_STATUS`); None for none."""
    for cls in type(exc).__mro__:
        status = DOMAIN_STATUS.get(cls)
        if status is not None:
            return status
    return None


def envelope(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"code": code, "message": message}}, headers=headers
    )


# Status recorded (metrics, access log) when the client went away before its answer; the
# nginx convention. Nothing is sent: there is no one to send it to.
CLIENT_CLOSED = 499

_DESCRIPTIONS = {
    400: "malformed request (e.g. an invalid Content-Length)",
    401: "missing, invalid or revoked credentials",
    403: "credentials of the wrong kind, a disabled tenant, or a quota reached",
    404: "no such resource (another tenant's resources are 404 too)",
    409: "conflicts with the current state",
    410: "gone",
    413: "the body is larger than the limit",
    415: "unsupported Content-Type",
    422: "invalid input",
    429: "concurrency, queue, rate or in-flight body limit reached; see Retry-After",
    500: "internal error",
    503: "no capacity, or the database unavailable, now; see Retry-After",
    504: "the invocation exceeded its time limit",
}


def error_responses(*statuses: int, **descriptions: str) -> dict[int | str, dict[str, object]]:
    """OpenAPI `responses` for the error statuses a route can answer, all with the envelope.

    Every route can answer 500, and 503 while the database is busy or out of reach;
    `descriptions` (keyed "s404" etc.) override the generic text.
    """
    out: dict[int | str, dict[str, object]] = {}
    for status in sorted({*statuses, 500, 503}):
        text = descriptions.get(f"s{status}", _DESCRIPTIONS[status])
        out[status] = {"model": ErrorEnvelope, "description": text}
    return out


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "rate_limited",
    500: "internal",
    503: "unavailable",
}


ErrorHandler = Callable[[Request, Exception], Any]


def handler_for(app: FastAPI, exc: Exception) -> ErrorHandler | None:
    """The app's handler for `exc` as FastAPI's exception middleware picks it (the closest
    class), for code that runs outside FastAPI's routing; the catch-all for Exception belongs
    to the server-error middleware outside."""
    handlers: dict[Any, ErrorHandler] = app.exception_handlers
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in handlers:
            return handlers[cls]
    return None


async def handle(app: FastAPI, request: Request, exc: Exception, last_resort: bool = False) -> Response:
    """`exc` answered by the app's own handler, as from a route; re-raised when it has none, or
    with `last_resort` answered by the app's handler for Exception (a 500)."""
    handler = handler_for(app, exc)
    if handler is None:
        if not last_resort:
            raise exc
        handler = app.exception_handlers[Exception]
    if inspect.iscoroutinefunction(handler):
        return cast(Response, await handler(request, exc))
    return cast(Response, await run_in_threadpool(handler, request, exc))


JSON_BODY_HINT = "send Content-Type: application/json with a JSON object body"
_NOT_AN_OBJECT = frozenset({"model_attributes_type", "model_type", "dict_type"})


def _body_message(request: Request, err: Mapping[str, Any]) -> str | None:
    """What to say when a JSON route's body is not a JSON object at all (not JSON, empty, a
    list): pydantic's own words ("Input should be a valid dictionary ...") do not say what to
    send. None for an error inside the object (a field's value), which pydantic says well."""
    loc = tuple(err.get("loc", ()))
    if not loc or loc[0] != "body":
        return None
    kind = err.get("type")
    if kind == "json_invalid":
        why = (err.get("ctx") or {}).get("error") or "JSON decode error"
        return f"the body is not valid JSON ({why}): {JSON_BODY_HINT}"
    if len(loc) != 1 or (kind not in _NOT_AN_OBJECT and kind != "missing"):
        return None
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        return f"the body was sent as {ctype}, not JSON: {JSON_BODY_HINT}"
    if kind == "missing":
        return f"the body is empty: {JSON_BODY_HINT}"
    got = type(err.get("input")).__name__
    named = {"list": "a JSON array", "str": "a JSON string", "int": "a JSON number", "float": "a JSON number", "bool": "a JSON boolean"}
    return f"the body is {named.get(got, 'not a JSON object')}: {JSON_BODY_HINT}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return envelope(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(DomainError)
    async def _domain_error(_: Request, exc: DomainError) -> JSONResponse:
        status = domain_status(exc)
        if status is None:  # a DomainError of no kind: a bug where it was raised
            log.error("domain error of no kind (%s): %s", type(exc).__name__, exc.message)
            return envelope(500, "internal", "internal error; the request was not completed")
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
        return envelope(status, exc.code, exc.message, headers)

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, exc: Rejected) -> JSONResponse:
        principal = request.scope.get("state", {}).get("principal")
        if principal is not None:
            request.app.state.metrics.rejected(principal.name, exc.reason.value)
        return envelope(429, "rate_limited", exc.message, {"Retry-After": str(exc.retry_after)})

    @app.exception_handler(NoCapacity)
    async def _no_capacity(_: Request, exc: NoCapacity) -> JSONResponse:
        return envelope(503, "no_capacity", f"{exc}; retry later", {"Retry-After": "1"})

    @app.exception_handler(SupervisorGone)
    async def _supervisor_gone(_: Request, exc: SupervisorGone) -> JSONResponse:
        return envelope(503, "unavailable", f"{exc}; retry later", {"Retry-After": "1"})

    @app.exception_handler(OperationalError)
    async def _database(_: Request, exc: OperationalError) -> JSONResponse:
        if unavailable(exc):  # the transaction was rolled back: the same request may be sent again
            log.warning("the database is unavailable: %s", str(exc.orig).strip()[:300])
            return envelope(503, "unavailable", "the database is busy or out of reach; the request was not completed, retry it", {"Retry-After": "1"})
        log.exception("database error")
        return envelope(500, "internal", "internal error; the request was not completed")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            whole = _body_message(request, err)
            if whole is not None:  # the body as a whole is wrong: nothing else is worth saying
                return envelope(422, "validation_error", whole)
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return envelope(422, "validation_error", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "error")
        message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
        if exc.status_code == 404 and message == "Not Found":
            message = "no such route"
        return envelope(exc.status_code, code, message, getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _client_disconnect(_: Request, exc: ClientDisconnect) -> Response:
        # The client went away while sending its body: not a server error, nothing to log
        # beyond one line, and no one to answer.
        log.info("the client closed the connection before its request was read")
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return envelope(500, "internal", "internal error; the request was not completed")
