"""`tensorwasm invocations`: invocation records of the tenant (API key)."""

from __future__ import annotations

import sys

import click

from app.cli.completion import complete_functions
from app.cli.context import Config, emit, emit_table, pass_config
from app.client import TensorWasmError
from app.queue.states import InvocationStatus

INVOCATION_COLUMNS = ("id", "function", "version", "status", "started_at", "duration_ms", "exit_code", "error")


@click.group()
def invocations() -> None:
    """List and show invocation records."""


@invocations.command("list")
@click.option("--function", help="only this function's invocations", shell_complete=complete_functions)
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
    """Write the stored stdout of a finished asynchronous invocation.

    Exits 0 only if it succeeded; otherwise whatever stdout it stored is still written, stderr
    says how it ended (status, exit code, error, stderr tail) and the command exits 1.
    """
    with cfg.tenant() as c:
        record = c.get_invocation(invocation_id)
        if not record.status.ended or record.status == InvocationStatus.SUCCEEDED:
            sys.stdout.buffer.write(c.invocation_output(invocation_id))  # 409 not_finished, 410 expired: errors
            sys.stdout.flush()
            return
        try:
            stored = c.invocation_output(invocation_id, any_status=True)
        except TensorWasmError as exc:
            if exc.status != 410:
                raise
            stored = b""  # expired: the record remains, and says how it ended
    sys.stdout.buffer.write(stored)
    sys.stdout.flush()
    line = f"error: invocation {record.id} ended {record.status}"
    if record.exit_code is not None:
        line += f" (exit code {record.exit_code})"
    click.echo(line + (f": {record.error}" if record.error else ""), err=True)
    if record.stderr_tail:
        click.echo(f"stderr_tail: {record.stderr_tail}", err=True)
    raise SystemExit(1)


@invocations.command("cancel")
@click.argument("invocation_id")
@pass_config
def cancel(cfg: Config, invocation_id: str) -> None:
    """Cancel a queued or running invocation."""
    with cfg.tenant() as c:
        emit(c.cancel_invocation(invocation_id))
