"""`tensorwasm invocations`: invocation records of the tenant (API key)."""

from __future__ import annotations

import sys

import click

from app.cli.context import Config, emit, emit_table, pass_config

INVOCATION_COLUMNS = ("id", "function", "version", "status", "started_at", "duration_ms", "exit_code", "error")


@click.group()
def invocations() -> None:
    """List and show invocation records."""


@invocations.command("list")
@click.option("--function", help="only this function's invocations")
@click.option("--status", help="only invocations in this status (e.g. guest_error)")
@click.option("--limit", type=click.IntRange(1, 1000), help="at most this many, newest first")
@click.option("--cursor", help="the next page: the cursor the previous page printed")
@pass_config
def list_invocations(cfg: Config, function: str | None, status: str | None, limit: int | None, cursor: str | None) -> None:
    """List recent invocations, a page at a time."""
    with cfg.tenant() as c:
        page = c.list_invocations(function=function, status=status, limit=limit, cursor=cursor)
    emit_table(cfg, page.items, INVOCATION_COLUMNS)
    if page.next_cursor:
        click.echo(f"more: --cursor {page.next_cursor}", err=True)


@invocations.command("get")
@click.argument("invocation_id")
@pass_config
def get_invocation(cfg: Config, invocation_id: str) -> None:
    """Show one invocation: status, timings, exit code, error, stderr tail."""
    with cfg.tenant() as c:
        emit(c.get_invocation(invocation_id))


@invocations.command("output")
@click.argument("invocation_id")
@pass_config
def output(cfg: Config, invocation_id: str) -> None:
    """Write the stored stdout of a finished asynchronous invocation."""
    with cfg.tenant() as c:
        sys.stdout.buffer.write(c.invocation_output(invocation_id))
    sys.stdout.flush()


@invocations.command("cancel")
@click.argument("invocation_id")
@pass_config
def cancel(cfg: Config, invocation_id: str) -> None:
    """Cancel a queued or running invocation."""
    with cfg.tenant() as c:
        emit(c.cancel_invocation(invocation_id))
