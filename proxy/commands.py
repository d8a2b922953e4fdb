"""``harnessrl proxy``: run the capture proxy until SIGTERM/SIGINT.

On SIGTERM the proxy stops accepting connections, lets in-flight calls finish (up to
``--shutdown-timeout``), then writes the queue to the store -- or to the spool if the store does not answer
in that time -- and exits 0. Every flag has an environment variable (``proxy/config.py``).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
import sys
from pathlib import Path

import click

from .config import ConfigError, ProxyConfig, load_config

log = logging.getLogger("harnessrl.proxy")

# Libraries whose INFO lines say nothing a proxy user needs (alembic alone logs seven plugin lines at start);
# they log at WARNING and above whatever --log-level says.
QUIET_LIBRARIES = ("alembic", "sqlalchemy", "aiohttp", "asyncio", "httpx", "httpcore", "urllib3")

OBSERVE_NOTICE = (
    "observe mode: requests go upstream unchanged and each call is stored with its request and response only: "
    "no token ids, no log-probs and zero token counts, so no call can be trained on (--mode train keeps them)"
)


def configure_logging(level: str, log_calls: bool) -> None:
    """Our own lines at ``level``, one line per call unless ``log_calls`` is off, libraries at WARNING."""
    from .call_log import CALL_LOGGER

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    logging.getLogger(CALL_LOGGER).setLevel(logging.NOTSET if log_calls else logging.WARNING)

# The writer thread runs the store's (pure Python) encoding while the event loop serves requests; a thread
# that wants the GIL otherwise waits up to 5 ms for the other to yield it. 0.5 ms keeps that wait below the
# proxy's own per-call cost (measured: p50 added latency at concurrency 1, bench/proxy_overhead.py).
GIL_SWITCH_INTERVAL_S = 0.0005

# A call decodes its upstream answer into ~600 containers (a chat answer's log-prob entries) that all die when
# the call ends, by reference counting: a serving proxy makes no cyclic garbage (measured: 0 objects over 500
# calls at concurrency 64, gc.DEBUG_SAVEALL). At Python's default of 700 the youngest generation was collected
# every ~6 calls, each time scanning the answers in flight for nothing: 0.1 ms a call, 8% of the proxy's CPU
# (bench/proxy_overhead.py). At 10,000 that cost is ~15x rarer (measured: 6% less CPU a call), and garbage
# from rarer paths (errors, exceptions) is still collected within seconds.
GC_YOUNG_THRESHOLD = 10_000


async def _serve(config: ProxyConfig) -> None:
    from harnessrl.store import TraceStore

    from .app import CaptureProxy, start_metrics, start_proxy

    loop = asyncio.get_running_loop()
    # Not checked by connecting: a database that is down (restarting, or its DNS name not yet resolvable) must
    # not stop the proxy, which spools every call until the store answers (_require_schema tolerates it too).
    store = await loop.run_in_executor(None, functools.partial(TraceStore.connect, config.store_url, check=False))
    try:
        if config.store_upgrade:
            await loop.run_in_executor(None, store.upgrade)
        else:
            await loop.run_in_executor(None, _require_schema, store)
        proxy = CaptureProxy(config, store)
        runner, url = await start_proxy(proxy, config.proxy_host, config.proxy_port)
        metrics = await start_metrics(proxy, config.metrics_port) if config.metrics_port else None
        # Start-up objects (modules, app, engine) are never scanned by the cyclic collector again, and the
        # youngest generation is collected every GC_YOUNG_THRESHOLD allocations, not 700 (why: see there).
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        mode = f"sidecar for {config.rollout_id}/{config.attempt}" if config.sidecar else "gateway"
        log.info(
            "harnessrl proxy listening on %s (%s, %s mode, upstreams %s)",
            url,
            mode,
            config.proxy_mode,
            ", ".join(config.upstreams),
        )
        if not config.train:
            log.warning(OBSERVE_NOTICE)
        await stop.wait()
        log.info("stopping: no new connections, finishing in-flight calls, flushing captured calls")
        if metrics is not None:
            await metrics.cleanup()
        await runner.cleanup()
    finally:
        await loop.run_in_executor(None, store.close)


class StoreNotReady(RuntimeError):
    """The store answers but has no (or an older) harnessrl schema: every call would be spooled forever."""


def _require_schema(store: object) -> None:
    """Refuse to serve on a store that answers but was never migrated (or is behind this version).

    A store that does not answer is fine: the proxy spools calls until it does, which is what a sidecar
    started before the database needs.
    """
    from sqlalchemy.exc import OperationalError

    from harnessrl.store.migrate import current_revision, head_revision

    try:
        current = current_revision(store.engine)  # type: ignore[attr-defined]
    except OperationalError:
        return
    head = head_revision()
    if current != head:
        url = store.url  # type: ignore[attr-defined]
        state = "has no harnessrl schema" if current is None else f"is at schema revision {current}, not {head}"
        raise StoreNotReady(f"the store {url} {state} — run `harnessrl db upgrade --url {url}` first, or start "
                            "the proxy with --upgrade-db")


def _run(main: object) -> None:
    """uvloop when installed (it is in the proxy image): faster sockets for the same asyncio code."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)  # type: ignore[arg-type]
        return
    uvloop.run(main)  # type: ignore[arg-type]


@click.command("proxy")
@click.option(
    "--upstream",
    "upstreams",
    multiple=True,
    metavar="URL",
    help="vLLM server root URL; repeat for several. [env HARNESSRL_UPSTREAMS, comma-separated]",
)
@click.option(
    "--store",
    "store_url",
    metavar="URL",
    help="Trace store URL (postgresql+psycopg://... or sqlite:///path). [env HARNESSRL_STORE_URL]",
)
@click.option("--port", "proxy_port", type=int, help="Listen port. [env HARNESSRL_PROXY_PORT, default 8100]")
@click.option("--host", "proxy_host", help="Listen address. [env HARNESSRL_PROXY_HOST, default 127.0.0.1]")
@click.option(
    "--metrics-port",
    type=int,
    help="Also serve /metrics alone on this port, on every address (for Prometheus). [env HARNESSRL_METRICS_PORT]",
)
@click.option(
    "--mode",
    "proxy_mode",
    type=click.Choice(["train", "observe"]),
    help="train: force token ids + log-probs and the run's sampling. [env HARNESSRL_PROXY_MODE]",
)
@click.option("--run", help="Run name stored with every call. [env HARNESSRL_RUN]")
@click.option("--rollout-id", help="Sidecar attribution; unset = gateway mode. [env HARNESSRL_ROLLOUT_ID]")
@click.option("--attempt", type=int, help="Sidecar attribution attempt. [env HARNESSRL_ATTEMPT]")
@click.option("--model-name", help="Model name forced on every upstream call. [env HARNESSRL_MODEL_NAME]")
@click.option(
    "--sampling",
    metavar="JSON",
    help="Sampling fields forced in train mode, e.g. '{\"temperature\": 1.0}'. [env HARNESSRL_SAMPLING]",
)
@click.option(
    "--evaluation-sampling",
    metavar="JSON",
    help="Sampling fields for evaluation rollouts' calls, over --sampling. [env HARNESSRL_EVALUATION_SAMPLING]",
)
@click.option("--policy-version", type=int, help="Policy version at start. [env HARNESSRL_POLICY_VERSION]")
@click.option(
    "--spool",
    "spool_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Spool file for calls the store cannot take yet. [env HARNESSRL_SPOOL_PATH]",
)
@click.option(
    "--token-continuity/--no-token-continuity",
    default=None,
    help="Send chat calls that extend the previous one as token ids. [env HARNESSRL_TOKEN_CONTINUITY]",
)
@click.option(
    "--upgrade-db",
    "store_upgrade",
    is_flag=True,
    default=None,
    help="Run the store's migrations first (local runs). [env HARNESSRL_STORE_UPGRADE]",
)
@click.option(
    "--shutdown-timeout",
    "shutdown_timeout_s",
    type=float,
    help="Seconds in-flight calls and the final flush may take on SIGTERM. "
    "[env HARNESSRL_SHUTDOWN_TIMEOUT_S]",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.option(
    "--log-calls/--no-log-calls",
    default=True,
    show_default=True,
    envvar="HARNESSRL_LOG_CALLS",
    help="One INFO line per LLM call: rollout, status, tokens, latency. [env HARNESSRL_LOG_CALLS]",
)
def proxy_command(log_level: str, log_calls: bool, **flags: object) -> None:
    """OpenAI-compatible capture proxy: record every LLM call token-exactly into the trace store."""
    configure_logging(log_level, log_calls)
    if not flags.get("upstreams"):
        flags["upstreams"] = None
    else:
        flags["upstreams"] = list(flags["upstreams"])  # type: ignore[arg-type]
    try:
        config = load_config(**flags)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        _run(_serve(config))
    except StoreNotReady as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # e.g. the port is taken
        raise click.ClickException(
            f"cannot serve on {config.proxy_host}:{config.proxy_port}: {exc}"
        ) from None
