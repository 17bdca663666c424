"""Issue 23 item 7: /docs and /redoc work offline: their HTML names no external URL, and every
script, stylesheet and icon it names, and the OpenAPI document, is served by the app itself."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from hstu.config import ServeConfig
from hstu.serve.app import ServePolicy, create_app

ASSET = re.compile(r"""(?:src|href|spec-url)="([^"]+)"|url: '([^']+)'""")


async def _get_page_and_assets(app, page: str) -> tuple[httpx.Response, dict[str, httpx.Response]]:
    # the ASGI app called in process, without its lifespan: the model is not started, the docs need none
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hstu.test") as client:
        r = await client.get(page)
        assets = {a for groups in ASSET.findall(r.text) for a in groups if a}
        return r, {a: await client.get(a) for a in assets}


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_page_loads_nothing_from_outside(rec, page):
    app = create_app(ServeConfig(buckets=(16, 50)), rec, policy=ServePolicy(warmup=False))
    r, assets = asyncio.run(_get_page_and_assets(app, page))
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert not re.search(r"https?://|//cdn|fonts\.googleapis", r.text), re.findall(r"https?://\S+", r.text)
    assert any(a.endswith(".js") for a in assets) and "/openapi.json" in assets, sorted(assets)
    for a, got in assets.items():
        assert got.status_code == 200 and len(got.content) > 100, a
    if page == "/docs":  # Swagger UI's default would send the spec's URL to validator.swagger.io
        assert '"validatorUrl": null' in r.text
