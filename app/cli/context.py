"""What every command shares: where the server is, the credentials, and how results print."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
from pydantic import BaseModel, ValidationError

from app.client import DEFAULT_URL, AdminClient, TensorWasmClient, TensorWasmError

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


@dataclass
class Config:
    url: str
    admin_token: str | None
    api_key: str | None
    as_json: bool

    def admin(self, timeout: float = 120.0) -> AdminClient:
        token = self.admin_token or self._local_admin_token()
        if not token:
            raise click.UsageError(
                "no admin token: set TENSORWASM_ADMIN_TOKEN or pass --admin-token "
                "(against a local server, the data dir's admin_token file is read)"
            )
        return AdminClient(self.url, token, timeout=timeout)

    def tenant(self, timeout: float = 120.0) -> TensorWasmClient:
        if not self.api_key:
            raise click.UsageError("no API key: set TENSORWASM_API_KEY or pass --api-key")
        return TensorWasmClient(self.url, self.api_key, timeout=timeout)

    def _local_admin_token(self) -> str | None:
        """A server on this machine saved its generated token in its data dir."""
        if urlsplit(self.url).hostname not in LOOPBACK:
            return None
        from app.settings import Settings

        path = Path(Settings().data_dir) / "admin_token"
        try:
            return path.read_text().strip() or None
        except OSError:
            return None


pass_config = click.make_pass_decorator(Config)


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def emit(value: Any) -> None:
    """One object: indented JSON (it is both readable and scriptable)."""
    click.echo(json.dumps(_plain(value), indent=2))


def emit_table(cfg: Config, rows: Sequence[Any], columns: Iterable[str]) -> None:
    """A list: a table of the main columns, or with --json the full records."""
    if cfg.as_json:
        click.echo(json.dumps([_plain(r) for r in rows], indent=2))
        return
    cols = list(columns)
    cells = [[_cell(getattr(r, c, None)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    for row in [[c.upper() for c in cols], *cells]:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    if hasattr(value, "isoformat"):
        return value.isoformat(timespec="seconds")
    return str(value)


class CliError(click.ClickException):
    """A failure the command line explains in one line on stderr (what went wrong, what to do);
    exit status 1. Raised by commands for what they find wrong before or without the server."""

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class FiniteFloat(click.ParamType):
    """A float that JSON can carry: nan and inf are refused as the flag's usage error."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number (nan and inf are not allowed)", param, ctx)
        return float(number)


# What to do about a failure without an answer from the server, by its code.
_NO_ANSWER_HINTS = {
    "unreachable": "is the server running? start one with `tensorwasm serve`, or give its address with --url or TENSORWASM_URL",
    "timeout": "the server may be overloaded; retry, or check it with `curl URL/readyz`",
    "invalid_url": f"set TENSORWASM_URL or pass --url, e.g. {DEFAULT_URL}",
}


def fail(exc: TensorWasmError) -> int:
    """The server's message on stderr (or why there was no answer, and what to do); exit 1."""
    if exc.status == 0:
        hint = _NO_ANSWER_HINTS.get(exc.code)
        click.echo(f"error: {exc.message}" + (f": {hint}" if hint else ""), err=True)
        return 1
    click.echo(f"error: {exc}", err=True)
    for key in ("exit_code", "stderr_tail"):
        if exc.details.get(key) not in (None, ""):
            click.echo(f"{key}: {exc.details[key]}", err=True)
    if exc.retry_after is not None:
        click.echo(f"retry after: {exc.retry_after:g} s", err=True)
    return 1


def unexpected(exc: Exception) -> int:
    """A failure no command foresaw, in one line (--debug shows the traceback); exit 1."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        click.echo(f"error: {exc.strerror}{where}", err=True)
    elif isinstance(exc, ValidationError) and exc.title == "Settings":
        first = exc.errors()[0]
        name = "TENSORWASM_" + "_".join(str(p) for p in first["loc"]).upper()
        click.echo(f"error: the setting {name} is invalid ({first['msg']}): fix it in the environment or the .env file", err=True)
    else:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        click.echo(f"error: {type(exc).__name__}{': ' + text if text else ''} (run again with --debug for the traceback)", err=True)
    return 1


def status(message: str) -> None:
    """Progress and notes go to stderr, so stdout stays the result."""
    click.echo(message, err=True)


def stdin_bytes() -> bytes:
    return b"" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()
