"""``harnessrl ui``: serve the trace explorer for a run directory or a store URL."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("ui")
@click.argument("run_dir", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--store", "store_url", envvar="HARNESSRL_STORE_URL", metavar="URL",
              help="Store URL (sqlite:///... or postgresql+psycopg://...) instead of a run directory "
                   "[env HARNESSRL_STORE_URL].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8501, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(file_okay=False), default="",
              help="A model directory with tokenizer.json, to show token texts (default: the run's model.path "
                   "when this machine has it; token ids otherwise).")
def ui_command(run_dir: Path | None, store_url: str | None, host: str, port: int, tokenizer_dir: str) -> None:
    """Browse runs, rollouts and the exact training rows in a browser (read-only, updates live)."""
    from aiohttp import web

    from harnessrl.store import StoreError
    from harnessrl.store.engine import safe_url
    from harnessrl.ui.app import make_app
    from harnessrl.ui.store_access import open_read_only

    source = click.get_current_context().get_parameter_source("store_url")
    if run_dir is not None and source is click.core.ParameterSource.ENVIRONMENT:
        store_url = None  # a RUN_DIR on the command line wins over $HARNESSRL_STORE_URL
    if (run_dir is None) == (store_url is None):
        raise click.UsageError("give a run directory (RUN_DIR) or --store URL, not both and not neither")
    if run_dir is not None:
        from harnessrl.local.report import read_run_file

        try:
            _, store_url = read_run_file(run_dir)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    assert store_url is not None
    try:
        engine = open_read_only(store_url)
        app = make_app(engine, tokenizer_dir)
    except (StoreError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"harnessrl ui: {safe_url(store_url)} (read-only) on http://{host}:{port}/")
    web.run_app(app, host=host, port=port, print=None, access_log=None, shutdown_timeout=2)  # nothing to flush
