"""The trace explorer's HTTP layer: one handler per page, each a thin call into ``queries``/``pages``.

Handlers run the store's synchronous reads in the default thread pool and render Jinja2 templates; a missing
run, rollout or step is a 404 page naming it, a store at an older schema revision a 503 page with the
``harnessrl db upgrade`` command, a bad filter a 400 page naming the parameter.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import threading
from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web
from sqlalchemy import Engine

from harnessrl.store import NotFound
from harnessrl.ui import pages
from harnessrl.ui.queries import BadQuery
from harnessrl.ui.store_access import SchemaCheck

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
VENDOR = STATIC / "vendor"
ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
SCHEMA: web.AppKey[SchemaCheck] = web.AppKey("schema", SchemaCheck)
TEMPLATES: web.AppKey[jinja2.Environment] = web.AppKey("templates", jinja2.Environment)
TOKENIZER: web.AppKey[str] = web.AppKey("tokenizer", str)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("harnessrl.ui", "templates"),
                             autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined)
    env.filters["fmt"] = _fmt
    env.filters["tojson_attr"] = lambda value: json.dumps(value)
    env.globals["urlencode"] = urlencode
    return env


def render(request: web.Request, name: str, status: int = 200, **context: Any) -> web.Response:
    html = request.app[TEMPLATES].get_template(name).render(path=request.path_qs, **context)
    return web.Response(text=html, content_type="text/html", status=status)


def _error_page(request: web.Request, status: int, title: str, message: str) -> web.Response:
    return render(request, "error.html", status=status, title=title, message=message)


@web.middleware
async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    """Schema check first (a store to upgrade gets the command), then pages' NotFound/BadQuery as 404/400."""
    if not request.path.startswith("/static/"):
        problem = await asyncio.get_running_loop().run_in_executor(None, request.app[SCHEMA].problem)
        if problem is not None:
            return _error_page(request, 503, "The store needs an upgrade", problem)
    try:
        return await handler(request)
    except NotFound as exc:
        return _error_page(request, 404, "Not found", str(exc))
    except BadQuery as exc:
        return _error_page(request, 400, "Bad filter", str(exc))
    except web.HTTPNotFound:
        return _error_page(request, 404, "Not found", f"no page at {request.path}")


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, partial(fn, *args))


async def runs_page(request: web.Request) -> web.Response:
    return render(request, "runs.html", **await _in_thread(pages.runs, request.app[ENGINE]))


async def overview_page(request: web.Request) -> web.Response:
    context = await _in_thread(pages.overview, request.app[ENGINE], request.match_info["run"])
    return render(request, "overview.html", **context)


async def rollouts_page(request: web.Request) -> web.Response:
    context = await _in_thread(pages.rollouts, request.app[ENGINE], request.match_info["run"],
                               dict(request.query))
    return render(request, "rollouts.html", **context)


async def rollout_page(request: web.Request) -> web.Response:
    context = await _in_thread(pages.rollout, request.app[ENGINE], request.match_info["run"],
                               request.match_info["rollout"], dict(request.query), request.app[TOKENIZER])
    return render(request, "rollout.html", **context)


async def failures_page(request: web.Request) -> web.Response:
    context = await _in_thread(pages.failures, request.app[ENGINE], request.match_info["run"])
    return render(request, "failures.html", **context)


async def compare_page(request: web.Request) -> web.Response:
    context = await _in_thread(pages.compare, request.app[ENGINE], request.match_info["run"], dict(request.query))
    return render(request, "compare.html", **context)


async def call_json(request: web.Request) -> web.Response:
    record = await _in_thread(pages.call_record, request.app[ENGINE], request.match_info["call"])
    return web.json_response(record, dumps=partial(json.dumps, ensure_ascii=False, indent=1))


def make_app(engine: Engine, tokenizer_dir: str = "") -> web.Application:
    """The application over a read-only ``engine`` (``store_access.open_read_only``)."""
    if not (VENDOR / "uPlot.iife.min.js").is_file():
        raise RuntimeError(f"the UI's chart library is missing from {VENDOR}: fetch it with "
                           f"`python {HERE / 'vendor.py'}` (needs npm), or install a harnessrl wheel")
    # The token view runs the learner's code (torch): imported in the background, so the server answers at once
    # and the first rollout page finds it loaded.
    threading.Thread(target=importlib.import_module, args=("harnessrl.ui.training_view",), daemon=True).start()
    app = web.Application(middlewares=[errors])
    app[ENGINE] = engine
    app[SCHEMA] = SchemaCheck(engine)
    app[TEMPLATES] = templates()
    app[TOKENIZER] = tokenizer_dir
    app.router.add_get("/", runs_page)
    app.router.add_get("/runs/{run}", overview_page)
    app.router.add_get("/runs/{run}/rollouts", rollouts_page)
    app.router.add_get("/runs/{run}/rollouts/{rollout}", rollout_page)
    app.router.add_get("/runs/{run}/failures", failures_page)
    app.router.add_get("/runs/{run}/compare", compare_page)
    app.router.add_get("/api/calls/{call}", call_json)
    app.router.add_static("/static/", STATIC)
    return app
