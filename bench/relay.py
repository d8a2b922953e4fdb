"""A relay that forwards POST bodies to an upstream and the answers back, and does nothing else.

``proxy_overhead.py`` measures it beside the capture proxy: an extra HTTP hop through aiohttp on uvloop (two more
socket round trips, two more processes to wake) costs latency before any parsing or capture, and on a small
shared machine that floor is a large part of the proxy's added latency. Same stack as the proxy, no work.

    python bench/relay.py UPSTREAM_URL PORT
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web


def make_app(upstream: str) -> web.Application:
    app = web.Application()

    async def session_context(app: web.Application) -> AsyncIterator[None]:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        yield
        await app["session"].close()

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        url = f"{upstream}/v1/{request.match_info['tail']}"
        async with app["session"].post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as answer:
            data = await answer.read()
        return web.Response(body=data, status=answer.status, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.cleanup_ctx.append(session_context)
    # the gateway path shape the benchmark's client uses against the proxy
    app.router.add_post("/rollouts/{rollout}/attempts/{attempt}/v1/{tail:.*}", relay)
    app.router.add_get("/healthz", health)
    return app


async def serve(upstream: str, port: int) -> None:
    runner = web.AppRunner(make_app(upstream), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()  # until the benchmark terminates the process


def main() -> None:
    uvloop.run(serve(sys.argv[1].rstrip("/"), int(sys.argv[2])))


if __name__ == "__main__":
    main()
