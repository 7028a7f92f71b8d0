from __future__ import annotations

import io
import json
import logging

import httpx

from app.observability.logging import ConsoleFormatter, JsonFormatter, _ContextFilter
from tests.helpers import deploy, new_tenant, wat


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
