"""What every command shares: where the server is, the credentials, and how results print."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
from pydantic import BaseModel

from app.client import AdminClient, TensorWasmClient, TensorWasmError

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


@dataclass
class Config:
    url: str
    admin_token: str | None
    api_key: str | None
    as_json: bool

    def admin(self) -> AdminClient:
        token = self.admin_token or self._local_admin_token()
        if not token:
            raise click.UsageError(
                "no admin token: set TENSORWASM_ADMIN_TOKEN or pass --admin-token "
                "(against a local server, the data dir's admin_token file is read)"
            )
        return AdminClient(self.url, token)

    def tenant(self) -> TensorWasmClient:
        if not self.api_key:
            raise click.UsageError("no API key: set TENSORWASM_API_KEY or pass --api-key")
        return TensorWasmClient(self.url, self.api_key)

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


def fail(exc: TensorWasmError) -> int:
    """The server's message on stderr; the command exits 1."""
    click.echo(f"error: {exc}", err=True)
    for key in ("exit_code", "stderr_tail"):
        if exc.details.get(key) not in (None, ""):
            click.echo(f"{key}: {exc.details[key]}", err=True)
    if exc.retry_after is not None:
        click.echo(f"retry after: {exc.retry_after:g} s", err=True)
    return 1


def status(message: str) -> None:
    """Progress and notes go to stderr, so stdout stays the result."""
    click.echo(message, err=True)


def stdin_bytes() -> bytes:
    return b"" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()
