from __future__ import annotations

import io
import json
import logging
import re

import httpx

from app.observability.logging import ConsoleFormatter, JsonFormatter, _ContextFilter
from tests.helpers import ADMIN, deploy, new_tenant, wat


async def test_json_lines_carry_request_tenant_and_invocation(client: httpx.AsyncClient) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(_ContextFilter())
    logger = logging.getLogger("app.services.invocations")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _, key = await new_tenant(client)
        await deploy(client, key, "trap", wat("trap"))
        r = await client.post("/v1/functions/trap/invoke", headers={**key, "X-Request-Id": "req-42"})
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    line = next(x for x in lines if "guest_error" in x["message"])
    assert line["request_id"] == "req-42"
    assert line["invocation_id"] == r.headers["x-invocation-id"]
    assert line["tenant"].startswith("t-") and line["level"] == "info" and line["time"].endswith("+00:00")


def test_console_format_is_readable() -> None:
    rec = logging.LogRecord("x", logging.WARNING, __file__, 1, "hello %s", ("world",), None)
    rec.request_id, rec.tenant, rec.invocation_id = "r1", "acme", None
    assert ConsoleFormatter().format(rec).endswith("WARNING x: hello world  [request_id=r1 tenant=acme]")


class _Lines(logging.Handler):
    """The access logger's records, formatted as a JSON-lines node writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.addFilter(_ContextFilter())
        self.lines: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


def _access_lines() -> tuple[_Lines, logging.Logger]:
    handler, logger = _Lines(), logging.getLogger("tensorwasm.access")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler, logger


async def test_one_access_line_per_request_by_default(client: httpx.AsyncClient) -> None:
    from app.settings import Settings

    assert Settings().access_log is True  # on unless TENSORWASM_ACCESS_LOG=false
    _, key = await new_tenant(client)
    await deploy(client, key, "echo", wat("echo"))
    handler, logger = _access_lines()
    try:
        r = await client.post("/v1/functions/echo/invoke", content=b"hi", headers={**key, "X-Request-Id": "acc-1"})
        assert r.status_code == 200
        missing = await client.get("/v1/functions/nope", headers={**key, "X-Request-Id": "acc-2"})
        assert missing.status_code == 404
        assert (await client.get("/v1/admin/workers", headers={**ADMIN, "X-Request-Id": "acc-3"})).status_code == 200
        assert (await client.get("/no/such/route", headers={"X-Request-Id": "acc-4"})).status_code == 404
    finally:
        logger.removeHandler(handler)
    by_id = {}
    for line in handler.lines:
        assert line["request_id"] not in by_id, f"two access lines for one request: {line}"
        by_id[line["request_id"]] = line
    assert set(by_id) == {"acc-1", "acc-2", "acc-3", "acc-4"}
    tenant = by_id["acc-1"]["tenant"]
    assert tenant.startswith("t-")
    assert re.fullmatch(rf"POST /v1/functions/\{{name\}}/invoke 200 \d+\.\dms tenant={tenant}", by_id["acc-1"]["message"])
    assert re.fullmatch(rf"GET /v1/functions/\{{name\}} 404 \d+\.\dms tenant={tenant}", by_id["acc-2"]["message"])
    assert re.fullmatch(r"GET /v1/admin/workers 200 \d+\.\dms tenant=-", by_id["acc-3"]["message"])
    assert re.fullmatch(r"GET unmatched 404 \d+\.\dms tenant=-", by_id["acc-4"]["message"])
    assert all(line["logger"] == "tensorwasm.access" and line["level"] == "info" for line in handler.lines)


async def test_access_log_off(app_factory) -> None:
    handler, logger = _access_lines()
    try:
        async with app_factory(access_log=False) as (client, _):
            assert (await client.get("/healthz")).status_code == 200
    finally:
        logger.removeHandler(handler)
    assert handler.lines == []
