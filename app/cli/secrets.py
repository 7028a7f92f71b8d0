"""`tensorwasm secrets`: the tenant's secrets (API key). Values go in, never come out."""

from __future__ import annotations

from typing import BinaryIO

import click

from app.cli.context import CliError, Config, emit_table, pass_config, status, stdin_bytes

SECRET_COLUMNS = ("name", "size", "created_at", "updated_at")


@click.group()
def secrets() -> None:
    """Keep, list and delete secrets that functions get as variables (deploy --secret NAME)."""


@secrets.command("set")
@click.argument("name")
@click.option("--from-file", "path", type=click.File("rb"), help="read the value from this file (as it is)")
@pass_config
def set_secret(cfg: Config, name: str, path: BinaryIO | None) -> None:
    """Keep the value read from stdin (or --from-file) as secret NAME, replacing it if it exists.
    Not an argument, so it stays out of shell history and process lists."""
    value = path.read() if path is not None else stdin_bytes()
    if not value:
        raise CliError("no value: pipe it on stdin (e.g. `printf %s \"$TOKEN\" | tensorwasm secrets set NAME`) or use --from-file")
    with cfg.tenant() as c:
        _, created = c.put_secret(name, value)
    status(f"{'created' if created else 'replaced'} secret {name} ({len(value)} bytes)")


@secrets.command("list")
@pass_config
def list_secrets(cfg: Config) -> None:
    """Names, sizes and times of the tenant's secrets (never values)."""
    with cfg.tenant() as c:
        emit_table(cfg, c.list_secrets(), SECRET_COLUMNS)


@secrets.command("delete")
@click.argument("name")
@pass_config
def delete_secret(cfg: Config, name: str) -> None:
    """Delete secret NAME (refused while a function's active version gets it)."""
    with cfg.tenant() as c:
        c.delete_secret(name)
    status(f"deleted secret {name}")
