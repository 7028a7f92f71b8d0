"""`tensorwasm functions versions|rollback`: a function's kept versions, and making one active."""

from __future__ import annotations

import click

from app.cli.completion import complete_functions
from app.cli.context import CliError, Config, emit, emit_table, pass_config, status
from app.cli.functions import functions

VERSION_COLUMNS = ("version", "active", "size", "sha256", "content_type", "timeout_ms", "secrets", "created_at")


@functions.command("versions")
@click.argument("name", shell_complete=complete_functions)
@pass_config
def list_versions(cfg: Config, name: str) -> None:
    """The versions function NAME keeps, oldest first; `active` marks the one calls run."""
    with cfg.tenant() as c:
        emit_table(cfg, c.list_versions(name), VERSION_COLUMNS)


@functions.command("rollback")
@click.argument("name", shell_complete=complete_functions)
@click.argument("version", required=False, type=click.IntRange(min=1))
@pass_config
def rollback(cfg: Config, name: str, version: int | None) -> None:
    """Make VERSION of function NAME the active one (default: the kept version before the
    active one); calls run it from the next one on."""
    with cfg.tenant() as c:
        if version is None:
            versions = c.list_versions(name)
            active = next((v.version for v in versions if v.active), None)
            older = [v.version for v in versions if active is not None and v.version < active]
            if not older:
                raise CliError(f"function {name} keeps no version before its active one ({active}); name a VERSION")
            version = older[-1]
        fn = c.rollback(name, version)
    status(f"function {name} runs version {fn.version}")
    emit(fn)
