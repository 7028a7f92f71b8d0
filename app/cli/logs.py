"""`tensorwasm logs NAME [-f]` and `tensorwasm callbacks`: a function's stderr lines, and the key
that signs callbacks (API key)."""

from __future__ import annotations

import click

from app.api.schemas import LogLineOut
from app.cli.completion import complete_functions
from app.cli.context import Config, emit, pass_config


def _print(cfg: Config, x: LogLineOut) -> None:
    if cfg.as_json:
        click.echo(x.model_dump_json())
    else:
        version = f"v{x.version}" if x.version is not None else "v-"
        click.echo(f"{x.time.isoformat(timespec='milliseconds')} {x.invocation_id} {version} {x.line}")


@click.command()
@click.argument("name", shell_complete=complete_functions)
@click.option("-f", "--follow", is_flag=True, help="keep printing new lines as calls end (Ctrl-C stops)")
@click.option("-n", "--lines", "limit", type=click.IntRange(1, 10_000), default=100, show_default=True, help="the newest lines to show first")
@pass_config
def logs(cfg: Config, name: str, follow: bool, limit: int) -> None:
    """Print what NAME's calls wrote to stderr: time, invocation id, version, line (--json: one
    JSON object a line)."""
    with cfg.tenant() as c:
        lines = c.follow_logs(name, limit=limit) if follow else iter(c.logs(name, limit=limit))
        try:
            for x in lines:
                _print(cfg, x)
        except KeyboardInterrupt:
            pass


@click.group()
def callbacks() -> None:
    """The key async callbacks are signed with."""


@callbacks.command("secret")
@click.option("--rotate", is_flag=True, help="replace it first: callbacks sent from now on use the new one")
@pass_config
def secret(cfg: Config, rotate: bool) -> None:
    """Show the tenant's callback signing secret (X-TensorWasm-Signature's HMAC key)."""
    with cfg.tenant() as c:
        emit(c.callback_secret(rotate=rotate))
