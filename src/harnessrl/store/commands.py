"""``harnessrl db``: create or upgrade a trace store's schema and show which revision it is at."""

from __future__ import annotations

import click
from alembic.util import CommandError
from sqlalchemy.exc import SQLAlchemyError

from harnessrl.store.engine import StoreError, first_line, open_engine, open_engine_waiting, safe_url
from harnessrl.store.migrate import current_revision, head_revision, upgrade

URL_OPTION = click.option(
    "--url",
    envvar="HARNESSRL_STORE_URL",
    required=True,
    help="Store database URL, e.g. sqlite:///runs/store.db or postgresql+psycopg://user:pw@host/db "
    "(default: $HARNESSRL_STORE_URL).",
)


@click.group("db")
def db_group() -> None:
    """Manage the trace store database."""


@db_group.command("upgrade")
@URL_OPTION
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds to keep retrying while the database cannot be reached (a chart's PostgreSQL that is still "
    "starting: its headless Service has no DNS name until the pod is ready).",
)
def upgrade_command(url: str, wait_s: float) -> None:
    """Apply all migrations (safe to run again, and from several pods at once)."""
    try:
        engine = open_engine_waiting(url, wait_s, lambda line: click.echo(line, err=True))
        try:
            revision = upgrade(engine)
        finally:
            engine.dispose()
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    except (SQLAlchemyError, CommandError) as exc:  # e.g. no CREATE permission, or a revision we do not know
        raise click.ClickException(f"cannot upgrade {safe_url(url)}: {first_line(exc)}") from None
    click.echo(f"{safe_url(url)}: at revision {revision} (head)")


@db_group.command("current")
@URL_OPTION
def current_command(url: str) -> None:
    """Print the schema revision the database is at and whether it is the newest."""
    try:
        engine = open_engine(url)
        try:
            revision = current_revision(engine)
        finally:
            engine.dispose()
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    except SQLAlchemyError as exc:
        raise click.ClickException(
            f"cannot read the revision of {safe_url(url)}: {first_line(exc)}"
        ) from None
    head = head_revision()
    if revision is None:
        click.echo(f"{safe_url(url)}: not migrated; run `harnessrl db upgrade --url ...` (head is {head})")
    elif revision == head:
        click.echo(f"{safe_url(url)}: at revision {revision} (head)")
    else:
        click.echo(f"{safe_url(url)}: at revision {revision}; head is {head}, run `harnessrl db upgrade`")
