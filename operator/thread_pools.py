"""Thread pools shared by every run an operator reconciles: the API calls in flight stay bounded however many
runs there are (a pool per run would multiply them)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The operator's one pool called ``name`` (created on first use with ``workers`` threads)."""
    with _lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        return pool
