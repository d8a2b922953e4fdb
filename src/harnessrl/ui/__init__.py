"""``harnessrl ui``: a read-only trace explorer in the browser.

What it shows that no dashboard can: each rollout's conversation as the harness saw it and, beside it, the
training rows exactly as the learner builds them (``training_view`` calls the learner's own functions).

Stack, and why:

* **aiohttp** serves it: it is already the proxy's web framework (the ``proxy`` extra), so the project keeps
  one HTTP stack; the store's queries are synchronous SQLAlchemy and run in the default thread pool, so a slow
  page never blocks another.
* **Jinja2** renders every page on the server (autoescaped): pages are plain HTML that work without
  JavaScript, filters and pagination are query parameters, and a test can read the numbers from the DOM.
* **uPlot** draws the per-step curves: a small, dependency-free charting library. Its files are pinned by
  version and integrity hash in ``assets.json``, fetched from the npm registry at build time
  (``harnessrl.ui.vendor``) and shipped in the wheel as package data; nothing is loaded from a CDN at run time.

Read-only by construction: the engine's connections are opened read-only (``PRAGMA query_only`` on SQLite,
``default_transaction_read_only`` on PostgreSQL), so even a bug here cannot write to a store.
"""
