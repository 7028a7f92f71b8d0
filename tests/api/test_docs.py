"""/docs and /redoc work offline: every script, style and icon they load is served by the node."""

from __future__ import annotations

import re

import httpx
import pytest


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_docs_pages_load_only_local_assets(client: httpx.AsyncClient, page: str) -> None:
    r = await client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "cdn." not in html and "fonts.googleapis" not in html
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html) + re.findall(r"""(?:url|spec-url)[:=]\s*["']([^"']+)["']""", html)
    assert urls, html
    assert "/openapi.json" in urls
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), f"{page} loads {url} from elsewhere"
        asset = await client.get(url)
        assert asset.status_code == 200, (url, asset.status_code)
        assert asset.content
    scripts = [u for u in urls if u.endswith(".js")]
    assert scripts
    for url in scripts:
        assert (await client.get(url)).headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript")


async def test_swagger_ui_fetches_no_validator_badge(client: httpx.AsyncClient) -> None:
    html = (await client.get("/docs")).text
    assert '"validatorUrl": null' in html
    assert (await client.get("/docs/oauth2-redirect")).status_code == 200
