"""`tensorwasm usage`: the tenant's quota and what it uses now (API key)."""

from __future__ import annotations

import click

from app.cli.context import Config, emit, pass_config


@click.command()
@pass_config
def usage(cfg: Config) -> None:
    """Quota, counts, running and queued invocations, GPU bytes in use."""
    with cfg.tenant() as c:
        emit(c.usage())
