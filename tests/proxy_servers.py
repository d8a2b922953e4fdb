"""Real servers for the proxy tests: a fake vLLM upstream and capture proxies, on a background event loop.

The servers run on their own thread's event loop so tests can use blocking clients (the ``openai`` SDK,
``httpx``) against them, exactly like a harness would.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web

from harnessrl.proxy.app import CaptureProxy, start_proxy
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.fake_upstream import FakeUpstream
from harnessrl.store import TraceStore

T = TypeVar("T")


def metric_value(exposition: str, sample: str, **labels: str) -> float | None:
    """One sample's value from a Prometheus text exposition (None when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


class LoopThread:
    """An asyncio loop running on a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class RunningUpstream:
    def __init__(self, loops: LoopThread, fake: FakeUpstream) -> None:
        self.loops = loops
        self.fake = fake
        self.runner = web.AppRunner(fake.app(), handler_cancellation=True, access_log=None)

        async def start() -> str:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            return f"http://127.0.0.1:{port}"

        self.url = loops.run(start())

    def stop(self) -> None:
        self.loops.run(self.runner.cleanup())


class RunningProxy:
    """A ``CaptureProxy`` over a real store, served on a free port."""

    def __init__(self, loops: LoopThread, config: ProxyConfig, store: TraceStore) -> None:
        self.loops = loops
        self.config = config
        self.store = store
        self.proxy = CaptureProxy(config, store)
        self.runner, self.url = loops.run(start_proxy(self.proxy, shutdown_timeout=5))
        self.stopped = False

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def flush(self, timeout: float = 30.0) -> None:
        assert self.proxy.writer.flush(timeout), "the proxy's writer did not drain in time"

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.loops.run(self.runner.cleanup())


def proxy_config(upstreams: list[str], store_url: str, spool: Path, **overrides: Any) -> ProxyConfig:
    """Config for a test proxy (a sidecar for rollout ``r-1`` unless overridden), fast retries."""
    values: dict[str, Any] = {
        "upstreams": upstreams,
        "store_url": store_url,
        "spool_path": spool,
        "upstream_backoff_s": 0.01,
        "upstream_backoff_max_s": 0.05,
        "spool_retry_s": 0.05,
        "rollout_id": "r-1",
        "run": "test-run",
    }
    values.update(overrides)
    return ProxyConfig(**values)


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def loops() -> Iterator[LoopThread]:
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.close()


@pytest.fixture
def upstream(loops: LoopThread) -> Iterator[RunningUpstream]:
    running = RunningUpstream(loops, FakeUpstream())
    yield running
    running.stop()


@pytest.fixture
def make_proxy(
    loops: LoopThread, store: TraceStore, store_url: str, tmp_path: Path
) -> Iterator[Callable[..., RunningProxy]]:
    """Factory: ``make_proxy([upstream urls], **config overrides)``; every proxy writes to ``store``."""
    made: list[RunningProxy] = []

    def make(upstreams: list[str], **overrides: Any) -> RunningProxy:
        spool = tmp_path / f"spool-{len(made)}.jsonl"
        running = RunningProxy(loops, proxy_config(upstreams, store_url, spool, **overrides), store)
        made.append(running)
        return running

    yield make
    for running in made:
        running.stop()
