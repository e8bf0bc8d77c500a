"""AdminClient's reading of answers that are not the gateway's: a Ray Serve proxy whose route
table does not yet hold the gateway answers a plain-text 404, which means "no gateway here yet"
(AdminUnreachable, which callers wait out) and not an API error about the request."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from infra.admin_client import AdminApiError, AdminClient, AdminUnreachable


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def _status_against(handler):
    runner, url = await _serve(handler)
    try:
        async with AdminClient(url, None, timeout_s=10) as client:
            return await client.status()
    finally:
        await runner.cleanup()


def test_a_proxy_without_the_gateway_route_is_unreachable_not_an_api_error():
    async def proxy(request):
        return web.Response(status=404, text=f"Path '{request.path}' not found. Ping http://x/-/routes for routes.")

    with pytest.raises(AdminUnreachable, match="no Thaw gateway is routed there yet"):
        asyncio.run(_status_against(proxy))


def test_the_gateways_own_404_stays_an_api_error_with_its_message():
    async def gateway(request):
        return web.json_response({"error": {"message": "model 'x' is not deployed", "param": "model"}}, status=404)

    with pytest.raises(AdminApiError) as info:
        asyncio.run(_status_against(gateway))
    assert info.value.status == 404 and info.value.message == "model 'x' is not deployed"
    assert info.value.param == "model"


def test_nothing_listening_is_unreachable():
    async def status():
        async with AdminClient("http://127.0.0.1:9", None, timeout_s=5) as client:
            return await client.status()

    with pytest.raises(AdminUnreachable, match="no Thaw gateway answers"):
        asyncio.run(status())
